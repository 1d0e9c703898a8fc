"""What dlo does to a user's module: its guard outside the graph, storage dtypes, the memory report."""
