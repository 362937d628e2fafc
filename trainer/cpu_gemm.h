// The CPU matrix products of a trainer's linear layers, through oneDNN.
//
// ATen computes an fp32 linear layer on the CPU with the BLAS it was built
// against; Debian's LibTorch uses OpenBLAS, whose kernel choice depends on
// the core type it recognises (or is told through OPENBLAS_CORETYPE), and
// on a CPU newer than the OpenBLAS it can fall back to kernels of an older
// generation. oneDNN picks its kernels from the instruction sets the CPU
// reports, and on the development machine its sgemm runs at about twice
// OpenBLAS's speed for a transformer's shapes (docs/open_trainer.md).
//
// troupe::trainer::linear is torch::nn::functional::linear with its three
// products (forward, input gradient, weight gradient) computed by
// dnnl_sgemm where it applies — float32, strided CPU tensors, CPU autocast
// off — and by ATen otherwise. It is also the TorchScript operator
// troupe::linear, and route_linear() rewrites a scripted module's
// aten::linear calls to it, so a user's torch.jit.script model gets the
// faster products without a change. oneDNN is found at run time
// (libdnnl.so.2, which Debian's LibTorch itself links); without it
// everything stays on ATen.
//
// Results equal ATen's within float32 rounding (not bitwise: the products
// sum in another order), and are deterministic for a given shape and thread
// count, so recovery from a peer or a checkpoint stays bitwise.
#pragma once

#include <optional>
#include <string>

#include <torch/types.h>

namespace torch::jit {
struct Module;
}

namespace troupe::trainer {

// Whether oneDNN's sgemm was found; the reason it was not otherwise.
bool onednn_available(std::string* why_not = nullptr);

// y = x · wᵀ (+ b), x [..., in], w [out, in], b [out]; differentiable.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& b = {});

// Rewrites every aten::linear of the module's methods, its submodules' and
// the script functions they call (before any of them has run) to
// troupe::linear; returns how many call sites.
int route_linear(torch::jit::Module& module);

}  // namespace troupe::trainer
