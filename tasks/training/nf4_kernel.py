"""model.matmul=bnb (issue 45): an NF4 base (model.quantize=nf4) stored in bitsandbytes' format and multiplied by
`bnb.matmul_4bit`, as OneTrainer's LinearNf4 and QLoRA (peft over bnb's Linear4bit) train, instead of torchao's
NF4Tensor decoded by a chain of torch ops (the fallback, `dequantize`: int64 indices, a gather, two scalings).

- Format: `bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")` on the
  compute-dtype weight. That is QLoRA's recipe (NF4 in blocks of 64, their absmax quantized again to 8 bits in
  blocks of 256: "double quantization", transformers' `bnb_4bit_use_double_quant`) and OneTrainer's (block 64,
  nested block 256), and the only nested block bnb's matmul_4bit takes. It costs torchao's NF4 bytes (half a byte,
  one per 64, an fp32 per 64 x 256); the numbers differ (bnb's second level is an 8-bit dynamic code around the
  absmaxes' mean, torchao's a symmetric int8), so the LoRA's key says which path trained it.
- Forward: `bnb.matmul_4bit` (on CUDA bnb's gemm_4bit picks per GPU and shape between its fused 4-bit kernel and
  its dequantize kernel plus a bf16 matmul; on the CPU its C dequantize, then the matmul). Input gradient: bnb's
  MatMul4Bit.backward, grad_out @ dequantize_4bit(W) in the gradient's dtype (fp8_base.upcast). Both inside
  fp8_base's autograd Function, which saves only the stored weight: train.blocks_to_swap's host weight is asked
  for again in backward, where bnb's own Function would keep the block's device copy alive until then.
- The weight is a tensor subclass on torchao's TorchAOBaseTensor holding bnb's packed bytes and quant state, so it
  is a frozen Parameter that `.to()`, block swap and the byte counts handle as they handle torchao's NF4Tensor."""
from __future__ import annotations

import torch
from torchao.utils import TorchAOBaseTensor

from tasks.training.w8a8 import BNB_MISSING

BLOCK, NESTED_BLOCK = 64, 256


class BnbNF4(TorchAOBaseTensor):
    """A frozen Linear weight [out, in] in bitsandbytes' NF4: `packed` (two 4-bit codes a byte), `absmax` (an 8-bit
    code per block of 64), `nested_absmax` and `offset` (fp32, the second level), and the two code books; its dtype
    is the compute dtype it dequantizes to."""

    tensor_data_names = ["packed", "absmax", "code", "nested_absmax", "nested_code", "offset"]
    tensor_attribute_names = ["shape", "dtype"]

    def __new__(cls, packed, absmax, code, nested_absmax, nested_code, offset, shape, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=packed.device,
                                                   requires_grad=False)

    def __init__(self, packed, absmax, code, nested_absmax, nested_code, offset, shape, dtype):
        super().__init__()
        self.packed, self.absmax, self.code = packed, absmax, code
        self.nested_absmax, self.nested_code, self.offset = nested_absmax, nested_code, offset

    def quant_state(self):
        """bnb's QuantState for these tensors (rebuilt per call: a few references, no copy)."""
        from bitsandbytes.functional import QuantState

        nested = QuantState(absmax=self.nested_absmax, code=self.nested_code, blocksize=NESTED_BLOCK,
                            dtype=torch.float32)
        return QuantState(absmax=self.absmax, shape=self.shape, code=self.code, blocksize=BLOCK, quant_type="nf4",
                          dtype=self.dtype, offset=self.offset, state2=nested)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        from bitsandbytes.functional import dequantize_4bit

        return dequantize_4bit(self.packed, self.quant_state()).to(dtype or self.dtype)


@BnbNF4.implements(torch.ops.aten.is_pinned.default)
def _is_pinned(func, types, args, kwargs):
    return all(getattr(args[0], n).is_pinned() for n in BnbNF4.tensor_data_names)


@BnbNF4.implements(torch.ops.aten._pin_memory.default)
def _pin_memory(func, types, args, kwargs):
    """Page-locked, as block swap holds a swapped block's host weights (torchao's tensors pin theirs too)."""
    return args[0]._apply_fn_to_data(lambda t: t.pin_memory())


def quantize(weight: torch.Tensor) -> BnbNF4:
    """`weight` (in the compute dtype, on the device that quantizes) in bitsandbytes' NF4."""
    try:
        from bitsandbytes.functional import quantize_4bit
    except (ImportError, RuntimeError) as e:
        from tasks.config import ConfigError

        raise ConfigError(BNB_MISSING) from e
    packed, state = quantize_4bit(weight, blocksize=BLOCK, compress_statistics=True, quant_type="nf4")
    nested = state.state2
    assert nested.blocksize == NESTED_BLOCK, nested.blocksize  # the one matmul_4bit takes
    return BnbNF4(packed, state.absmax, state.code, nested.absmax, nested.code, state.offset, weight.shape,
                  weight.dtype)


def linear(x: torch.Tensor, weight: BnbNF4, bias: torch.Tensor | None, compute_dtype: torch.dtype) -> torch.Tensor:
    """x @ W^T + b by bnb.matmul_4bit, in the dtype the fallback's F.linear takes here (autocast's, else the compute
    dtype): bnb's kernels take one dtype for the input and the bias, and autocast does not reach them."""
    import bitsandbytes as bnb

    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else compute_dtype
    return bnb.matmul_4bit(x.to(dtype), weight.packed, weight.quant_state(),
                           bias=None if bias is None else bias.to(dtype))
