"""Published dense matmul peaks of the accelerators, per compute dtype: the reference of
bench.py's MFU and of aot.py's step estimate and MFU bound."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Peak:
  """One device's dense (no sparsity) matmul peak in FLOP/s by the dtype the model computes in,
  and where the figures come from."""
  bfloat16: float
  float32: float
  source: str

  def flops(self, dtype: str) -> float:
    """float16 runs at bfloat16's rate on all of these."""
    return self.float32 if dtype == 'float32' else self.bfloat16


# float32 on NVIDIA GPUs: XLA's default precision multiplies float32 in TF32 on the tensor cores
# from Ampere on (an H100 measured 169 TFLOP/s in a float32 matmul, 2.5x its 67 non-tensor
# TFLOP/s), so its peak is TF32's. float32 on TPUs: the default precision multiplies in bfloat16
# passes on the MXU, so bfloat16's peak bounds it.
PEAKS = {
    # (device kind, lower case) -> Peak; the first kind the device's contains is taken.
    'h100 pcie': Peak(756e12, 378e12, 'NVIDIA H100 datasheet (PCIe): BF16 1,513 and TF32 756 '
                      'TFLOPS with sparsity; dense is half'),
    'h100 nvl': Peak(835e12, 417.5e12, 'NVIDIA H100 datasheet (NVL): BF16 1,671 and TF32 835 '
                     'TFLOPS with sparsity; dense is half'),
    'h100': Peak(989e12, 494.5e12, 'NVIDIA H100 datasheet (SXM5): BF16 1,979 and TF32 989 '
                 'TFLOPS with sparsity; dense is half'),
    'h200 nvl': Peak(835e12, 417.5e12, 'NVIDIA H200 product page (NVL): BF16 1,671 and TF32 835 '
                     'TFLOPS with sparsity; dense is half'),
    'h200': Peak(989e12, 494.5e12, 'NVIDIA H200 datasheet (SXM): BF16 1,979 and TF32 989 TFLOPS '
                 'with sparsity; dense is half'),
    'a100': Peak(312e12, 156e12, 'NVIDIA A100 datasheet: BF16 312 and TF32 156 TFLOPS dense'),
    'tpu v4': Peak(275e12, 275e12, 'Cloud TPU docs, TPU v4: 275 TFLOPS bf16 per chip'),
    'tpu v5 lite': Peak(197e12, 197e12, 'Cloud TPU docs, TPU v5e: 197 TFLOPS bf16 per chip'),
    'tpu v5': Peak(459e12, 459e12, 'Cloud TPU docs, TPU v5p: 459 TFLOPS bf16 per chip'),
    'tpu v6': Peak(918e12, 918e12, 'Cloud TPU docs, TPU v6e (Trillium): 918 TFLOPS bf16 per chip'),
}


def published(device_kind: str) -> Peak | None:
  """The published peak of a device kind as JAX reports it ('NVIDIA H100 80GB HBM3', 'TPU v5
  lite', ...); None for a kind not in the table (a CPU, another GPU)."""
  kind = device_kind.lower()
  return next((peak for name, peak in PEAKS.items() if name in kind), None)
