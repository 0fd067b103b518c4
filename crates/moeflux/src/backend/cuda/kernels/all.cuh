// moeflux's CUDA kernels: one source, compiled at run time by NVRTC for the
// device found (backend/cuda/device.rs concatenates these parts in this
// order; nvcc-built tools such as scripts/gpu/kbench include this file, and
// the CPU emulation in scripts/gpu/emu concatenates the same list). A part
// may use everything the parts before it define.
//
// Conventions: activations are f32, row-major [tokens, width]. Quantized
// weights are MLX affine (per row, `cols * bits / 32` u32 words holding the
// codes LSB-first, and per group of `gs` columns a scale and a bias, bf16 or
// f32: w = q * scale + bias) or MXFP4 (quant.cuh). Every kernel accumulates
// in f32.
#include "common.cuh"
#include "abi.cuh"
#include "quant.cuh"
#include "async_copy.cuh"
#include "qmatmul.cu"
#include "qmv.cu"
#include "qdot.cu"
#include "elementwise.cu"
#include "attention.cu"
#include "deltanet.cu"
#include "moe.cu"
#include "moe_route.cu"
#include "probe.cu"
#include "mla.cu"
#include "mma.cu"
#include "mma_q8.cu"
#include "mma_products.cu"
#include "mma_staged.cu"
#include "attn_mma.cu"
#include "deltanet_chunk.cu"
