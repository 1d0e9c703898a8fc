"""Applications built on the library, which the backend never imports: the engine, schedule dumps, the planning study, the demo and the `dlo-fx` command."""
