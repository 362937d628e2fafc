#include "troupe/trainer/cpu_gemm.h"

#include <dlfcn.h>

#include <unordered_set>
#include <vector>

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/script.h>
#include <torch/torch.h>

#include "troupe/trainer/torch_compat.h"

namespace troupe::trainer {
namespace {

// oneDNN's C entry point (dnnl.h): row-major C = alpha·op(A)·op(B) + beta·C,
// op(X) = X or Xᵀ as trans is 'N' or 'T'; returns dnnl_success (0) or an
// error status.
using Sgemm = int (*)(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                      int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

struct OneDnn {
  Sgemm sgemm = nullptr;
  std::string why_not;
};

const OneDnn& onednn() {
  static const OneDnn lib = [] {
    OneDnn l;
    // Only the copy LibTorch itself links (Debian's does), never one found
    // on disk beside a LibTorch with oneDNN built in (PyTorch's wheels): a
    // second oneDNN may bring an OpenMP of its own, which
    // torch::set_num_threads does not bound.
    void* handle = ::dlopen("libdnnl.so.2", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (!handle) {
      l.why_not = "LibTorch does not link libdnnl.so.2 (it has no oneDNN, or has it built in)";
      return l;
    }
    l.sgemm = reinterpret_cast<Sgemm>(::dlsym(handle, "dnnl_sgemm"));
    if (!l.sgemm) l.why_not = "libdnnl.so.2 has no dnnl_sgemm";
    return l;
  }();
  return lib;
}

void sgemm(char ta, char tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
           float beta, float* c, int64_t ldc) {
  const int status = onednn().sgemm(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
  TORCH_CHECK(status == 0, "dnnl_sgemm(", ta, ", ", tb, ", m=", m, ", n=", n, ", k=", k, ") failed with status ",
              status);
}

bool plain_cpu_float(const torch::Tensor& t) {
  return t.device().is_cpu() && t.layout() == torch::kStrided && t.scalar_type() == torch::kFloat &&
         !t.is_quantized() && !t.is_conj() && !t.is_neg();
}

// Whether oneDNN computes this linear; ATen does otherwise (other dtypes,
// devices and layouts, autocast, shapes linear itself would reject so its
// error is the one the user sees).
bool onednn_applies(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& b) {
  if (!onednn().sgemm || compat::cpu_autocast_enabled()) return false;
  if (!x.defined() || !w.defined() || !plain_cpu_float(x) || !plain_cpu_float(w)) return false;
  if (x.dim() < 1 || w.dim() != 2 || x.size(-1) != w.size(1) || x.numel() == 0 || w.numel() == 0) return false;
  if (b && b->defined() && (!plain_cpu_float(*b) || b->dim() != 1 || b->size(0) != w.size(0))) return false;
  return true;
}

std::vector<int64_t> out_shape(const torch::Tensor& x, int64_t n) {
  std::vector<int64_t> s(x.sizes().begin(), x.sizes().end());
  s.back() = n;
  return s;
}

// y = x·wᵀ + b with oneDNN, x viewed as [m, k]. The tensors it returns are
// allocated in their final shape (contiguous, so also [m, n] matrices), not
// views: autograd forbids in-place changes to a view a custom function
// returned, and models change a linear layer's output in place (ReLU with
// inplace=True, y += residual).
torch::Tensor forward_product(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  const int64_t k = w.size(1), n = w.size(0);
  const auto x2 = x.reshape({-1, k}).contiguous();
  const auto wc = w.contiguous();
  const int64_t m = x2.size(0);
  auto y = torch::empty(out_shape(x, n), x.options().memory_format(torch::MemoryFormat::Contiguous));
  float beta = 0.0f;
  if (b.defined()) {
    y.copy_(b);  // broadcast over the rows
    beta = 1.0f;
  }
  sgemm('N', 'T', m, n, k, x2.data_ptr<float>(), k, wc.data_ptr<float>(), k, beta, y.data_ptr<float>(), n);
  return y;
}

// The products above as autograd sees them: x, w and (with a bias) b are
// its differentiable inputs. Without a bias there is no third input at
// all (an undefined tensor is no input autograd accepts).
torch::autograd::variable_list gradients(torch::autograd::AutogradContext* ctx, const torch::Tensor& grad, bool bias) {
  const auto saved = ctx->get_saved_variables();
  const auto& x = saved[0];
  const auto& w = saved[1];
  const int64_t k = w.size(1), n = w.size(0);
  const auto g = grad.reshape({-1, n}).contiguous();
  const int64_t m = g.size(0);
  if (torch::GradMode::is_enabled()) {
    // backward(create_graph=True), a gradient of a gradient: computed with
    // ATen's differentiable ops, which record their own history (raw
    // products would return gradients without any).
    const auto x2 = x.reshape({-1, k});
    torch::autograd::variable_list out = {ctx->needs_input_grad(0) ? g.mm(w).reshape(x.sizes()) : torch::Tensor(),
                                          ctx->needs_input_grad(1) ? g.t().mm(x2) : torch::Tensor()};
    if (bias) out.push_back(ctx->needs_input_grad(2) ? g.sum(0) : torch::Tensor());
    return out;
  }
  torch::Tensor dx, dw;
  if (ctx->needs_input_grad(0)) {
    // dx = g · w: [m, n] · [n, k], in x's shape (see forward_product).
    const auto wc = w.contiguous();
    dx = torch::empty(x.sizes(), x.options().memory_format(torch::MemoryFormat::Contiguous));
    sgemm('N', 'N', m, k, n, g.data_ptr<float>(), n, wc.data_ptr<float>(), k, 0.0f, dx.data_ptr<float>(), k);
  }
  if (ctx->needs_input_grad(1)) {
    // dw = gᵀ · x: [n, m] · [m, k].
    const auto x2 = x.reshape({-1, k}).contiguous();
    dw = torch::empty({n, k}, w.options());
    sgemm('T', 'N', n, k, m, g.data_ptr<float>(), n, x2.data_ptr<float>(), k, 0.0f, dw.data_ptr<float>(), k);
  }
  if (!bias) return {dx, dw};
  return {dx, dw, ctx->needs_input_grad(2) ? g.sum(0) : torch::Tensor()};
}

class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const torch::Tensor& b) {
    ctx->save_for_backward({x, w});
    return forward_product(x, w, b);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return gradients(ctx, grads[0], true);
  }
};

class LinearNoBiasFunction : public torch::autograd::Function<LinearNoBiasFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w) {
    ctx->save_for_backward({x, w});
    return forward_product(x, w, torch::Tensor());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return gradients(ctx, grads[0], false);
  }
};

// The operator's schema takes c10::optional (LibTorch 1.13's is not
// std::optional).
torch::Tensor linear_op(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& b) {
  // Qualified: where c10::optional is std::optional (2.x) at::linear is as
  // good a match by argument-dependent lookup.
  return troupe::trainer::linear(x, w, b ? std::optional<torch::Tensor>(*b) : std::nullopt);
}

TORCH_LIBRARY(troupe, m) { m.def("linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor", &linear_op); }

struct Rewrite {
  c10::Symbol to = c10::Symbol::fromQualString("troupe::linear");
  c10::Symbol linear = c10::Symbol::fromQualString("aten::linear");
  c10::Symbol call_function = c10::Symbol::fromQualString("prim::CallFunction");
  std::unordered_set<torch::jit::Graph*> seen;
  int count = 0;
};

void rewrite_graph(const std::shared_ptr<torch::jit::Graph>& graph, Rewrite& r);

// The script function a prim::CallFunction calls (its first input is the
// function, a constant of FunctionType), when it has a graph.
std::shared_ptr<torch::jit::Graph> called_graph(torch::jit::Node* call) {
  if (call->inputs().empty()) return nullptr;
  auto type = call->input(0)->type()->cast<c10::FunctionType>();
  if (!type || !type->function() || !type->function()->isGraphFunction()) return nullptr;
  return torch::jit::toGraphFunction(*type->function()).graph();
}

void rewrite_block(torch::jit::Block* block, Rewrite& r) {
  for (auto it = block->nodes().begin(); it != block->nodes().end();) {
    torch::jit::Node* node = *it;
    ++it;
    for (auto* sub : node->blocks()) rewrite_block(sub, r);
    // Free script functions too (F.multi_head_attention_forward's
    // projections, a model's own helpers).
    if (node->kind() == r.call_function) {
      if (auto graph = called_graph(node)) rewrite_graph(graph, r);
      continue;
    }
    if (node->kind() != r.linear || node->inputs().size() != 3 || node->outputs().size() != 1) continue;
    auto* graph = node->owningGraph();
    auto* replacement = graph->create(r.to, node->inputs(), 1);
    replacement->insertBefore(node);
    replacement->output()->setType(node->output()->type());
    replacement->setSourceRange(node->sourceRange());
    node->output()->replaceAllUsesWith(replacement->output());
    node->destroy();
    ++r.count;
  }
}

void rewrite_graph(const std::shared_ptr<torch::jit::Graph>& graph, Rewrite& r) {
  if (r.seen.insert(graph.get()).second) rewrite_block(graph->block(), r);
}

}  // namespace

bool onednn_available(std::string* why_not) {
  const auto& lib = onednn();
  if (why_not) *why_not = lib.why_not;
  return lib.sgemm != nullptr;
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& b) {
  if (!onednn_applies(x, w, b)) {
    return torch::nn::functional::linear(x, w, b && b->defined() ? *b : torch::Tensor());
  }
  if (b && b->defined()) return LinearFunction::apply(x, w, *b);
  return LinearNoBiasFunction::apply(x, w);
}

int route_linear(torch::jit::Module& module) {
  Rewrite r;
  auto rewrite = [&](const torch::jit::Module& m) {
    for (const auto& method : m.get_methods()) rewrite_graph(torch::jit::toGraphFunction(method.function()).graph(), r);
  };
  rewrite(module);
  for (const auto& sub : module.modules()) rewrite(sub);
  return r.count;
}

}  // namespace troupe::trainer
