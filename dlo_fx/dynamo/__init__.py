"""The Dynamo seam: the `dlo` backend, its compile errors, and a correction to Dynamo."""
