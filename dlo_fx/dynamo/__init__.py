"""Compiling: the `dlo` backend Dynamo calls, the errors it raises past Dynamo, and
`compile_pipeline` (the private torch APIs they use are in dlo_fx/torch_private.py)."""
