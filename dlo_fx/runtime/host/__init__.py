"""Host side of the store: where a model's weights live off the device.

`HostStore` keeps each block's bytes in host memory (`host_store`) or serves them from the
checkpoint's files (`FileStore` in `file_store`, read in parallel pieces by `file_reads`);
`host_slabs` packs pinned shards into a few registered slabs; `layout` is the flat byte
layout of a block and the shard geometry; `fingerprint` samples a block's bytes so that
ranks and reloads can check they hold the same weights.
"""
