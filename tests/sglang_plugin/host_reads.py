"""Catch data-dependent host reads on CPU: the ops that, on a GPU, make the host wait for the
device (a value read back, or an output whose size depends on values)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# .item(), int(t), float(t), bool(t), .tolist() all come down to these two.
_READS = frozenset({"_local_scalar_dense", "is_nonzero", "equal"})
# Output sizes that depend on the values.
_VALUE_SIZED = frozenset({"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive"})
_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})


class HostReads(TorchDispatchMode):
    """Records (op name) for every op that would stall the host on a device tensor."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _READS or name in _VALUE_SIZED:
            self.seen.append(str(func))
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and isinstance(args[0], torch.Tensor):
            self.seen.append(f"{func} without output_size")
        elif name in _INDEX_OPS and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.seen.append(f"{func} with a boolean index")
        return func(*args, **kwargs)
