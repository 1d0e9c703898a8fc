"""Loading: checkpoints found and checked, the load plan, `dlo_fx.load`, per-rank shard folders, GGUF files."""
