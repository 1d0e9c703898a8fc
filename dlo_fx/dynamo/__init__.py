"""The Dynamo side: the `dlo` backend and the errors it raises past Dynamo (the private torch APIs both use are in dlo_fx/torch_private.py)."""
