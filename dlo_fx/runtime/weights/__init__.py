"""Parameters whose weights the runtime holds.

`stored` defines `StoredWeight`, the storage-less parameter whose reads are served from the
host store; `owners` records which runtime owns which parameters (`owner_of`, `claim`,
`live_runtimes`); `weight_reads` (`WeightReads`) serves reads of stored weights outside the
schedule.
"""
