"""`dflash-robot serve`: an OpenAI-compatible HTTP server over one `DFlashRuntime`.

    from dflash_robot.serve import ServeSettings, create_app
    app = create_app(DFlashRuntime.load(), ServeSettings(model_name="smollm2"))
    uvicorn.run(app, host="127.0.0.1", port=8000)

`app` (routes), `schemas` (request models), `engine` (the single worker that owns the
runtime), `formats` (OpenAI response bodies and SSE chunks), `metrics` (Prometheus),
`errors` (OpenAI's error shape). Needs the `serve` extra: fastapi, uvicorn, prometheus-client.
"""

from dflash_robot.serve.app import create_app
from dflash_robot.serve.settings import ServeSettings

__all__ = ["ServeSettings", "create_app"]
