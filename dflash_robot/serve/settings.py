"""Server settings (what `dflash-robot serve` passes to `create_app`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeSettings:
    model_name: str = "dflash-robot"  # the served model id; requests must name it
    api_key: str | None = None  # when set, /v1 endpoints need `Authorization: Bearer <api_key>`
    max_queue: int = 16  # requests waiting behind the running one before 429
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    block_size: int | None = None  # default block size (None: the draft's own default)
    adaptive: bool = False  # requests without block_size use the runtime's adaptive policy
    cost_cache: str | None = None  # the adaptive policy's cost-curve cache file
    default_max_tokens: int = 128  # when a request sets neither max_tokens nor max_completion_tokens
    retry_after_s: int = 1  # the Retry-After header of 429 and 503 answers

    def __post_init__(self) -> None:
        from dflash_robot.errors import ConfigError

        if self.max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_body_bytes < 1 or self.default_max_tokens < 1 or self.retry_after_s < 0:
            raise ConfigError("max_body_bytes and default_max_tokens must be >= 1, retry_after_s >= 0")
        if self.adaptive and self.block_size is not None:
            raise ConfigError("adaptive chooses the block size itself; drop block_size")
        if not self.model_name:
            raise ConfigError("model_name must be non-empty")
