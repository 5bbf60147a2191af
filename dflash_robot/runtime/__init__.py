"""The runtime loop: `orchestrator` (the one step generator), `proposer` (the draft side of
an iteration), `acceptance` and `sampling` (pure tensor functions), `policy` (block size per
iteration), `text` (detokenization, stop strings), `config`, and `api` (`DFlashRuntime`).

Nothing is imported here, so that `import dflash_robot.runtime.config` stays light."""
