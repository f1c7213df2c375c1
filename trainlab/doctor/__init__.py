"""`trainlab doctor`: check a machine before a long run, one line per check (PASS / WARN / FAIL / SKIP).

    report.py      `Check` (one result: status, what was found, the fix) and how results are printed (lines, JSON)
    versions.py    Python, torch, torchvision, the CUDA the wheel was built for, the driver, cuDNN, NCCL, trainlab
    gpu.py         per GPU: name, memory, compute capability vs the wheel's architectures, bf16 / TF32, SDPA
                   kernels, a cuDNN convolution, free memory; CUDA_VISIBLE_DEVICES; processes vs GPUs
    collective.py  one all-reduce across processes (NCCL over the GPUs; gloo in tests) with a deadline
    host.py        CPU cores vs loader workers, /dev/shm vs the loader's batches in flight, open-file limit, free disk
                   under the run directory vs the checkpoints the run keeps
    data.py        the data root: readable, images per class, unreadable files (the recipes' scanner and reader)

Every judgement is a function of plain inputs (sizes, versions, capabilities), so tests simulate a 64 MiB
`/dev/shm`, a full disk or a GPU the wheel was not built for without touching the machine; the functions that read
the machine (`gather_*`, `probe_*`) only collect those inputs.
"""
