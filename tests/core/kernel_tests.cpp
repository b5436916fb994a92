// The fused CPU kernels (kernels/) against the composite ops they replace: values and gradients,
// fp32 and bf16, sizes that leave a scalar tail and sizes split over two threads.
#include <cmath>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include <catch2/catch.hpp>

#include <meshtorch/meshtorch.hpp>

namespace mt = meshtorch;

namespace {

// The largest |a - b| over the largest |b| (at least 1), in fp64: an error relative to the
// tensor's scale, which a 1e-6 bound in fp32 or one of bf16's 2^-8 steps measures.
double max_difference(const torch::Tensor& a, const torch::Tensor& b) {
  REQUIRE(a.sizes() == b.sizes());
  const auto reference = b.to(torch::kDouble);
  const double scale = std::max(1.0, reference.abs().max().item<double>());
  return (a.to(torch::kDouble) - reference).abs().max().item<double>() / scale;
}

// Leaves of `shape` in `dtype`, drawn from N(0, 1) in fp32 so both dtypes see the same values.
torch::Tensor leaf(torch::IntArrayRef shape, torch::ScalarType dtype) {
  return torch::randn(shape).to(dtype).requires_grad_(true);
}

std::vector<torch::Tensor> copies(const std::vector<torch::Tensor>& leaves) {
  std::vector<torch::Tensor> out;
  for (const auto& t : leaves) out.push_back(t.detach().clone().requires_grad_(true));
  return out;
}

// Runs f on both copies of the inputs, backward from the same random weights of each output,
// and returns the largest difference of the outputs and of the inputs' gradients.
template <class Fused, class Composite>
std::pair<double, double> compare(const std::vector<torch::Tensor>& inputs, Fused fused, Composite composite) {
  const auto a = copies(inputs), b = copies(inputs);
  const std::vector<torch::Tensor> out_a = fused(a), out_b = composite(b);
  REQUIRE(out_a.size() == out_b.size());
  double values = 0, grads = 0;
  torch::Tensor loss_a = torch::zeros({}, torch::kDouble), loss_b = torch::zeros({}, torch::kDouble);
  for (std::size_t i = 0; i < out_a.size(); ++i) {
    values = std::max(values, max_difference(out_a[i], out_b[i]));
    const auto weights = torch::randn(out_a[i].sizes()).to(out_a[i].scalar_type());
    loss_a = loss_a + (out_a[i] * weights).sum().to(torch::kDouble);
    loss_b = loss_b + (out_b[i] * weights).sum().to(torch::kDouble);
  }
  loss_a.backward();
  loss_b.backward();
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!b[i].grad().defined()) continue;
    REQUIRE(a[i].grad().defined());
    grads = std::max(grads, max_difference(a[i].grad(), b[i].grad()));
  }
  return {values, grads};
}

// Both thread counts: one range of rows, and several (a weight's gradient summed over ranges).
struct WithThreads {
  explicit WithThreads(int threads) : before(torch::get_num_threads()) { torch::set_num_threads(threads); }
  ~WithThreads() { torch::set_num_threads(before); }
  int before;
};

}  // namespace

TEST_CASE("fused RMSNorm, alone and after a residual add, equals the composite in values and gradients", "[kernels]") {
  torch::manual_seed(3);
  const auto threads = GENERATE(1, 2);
  WithThreads with(threads);
  // 33 leaves a scalar tail after the vector lanes; 128 x 96 rows split over two threads.
  const auto shape = GENERATE(std::vector<std::int64_t>{7, 33}, std::vector<std::int64_t>{2, 3, 5},
                              std::vector<std::int64_t>{128, 96, 64});
  INFO("threads " << threads << ", shape " << torch::IntArrayRef(shape));
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    INFO("dtype " << dtype);
    const double tolerance = dtype == torch::kFloat ? 2e-6 : 2e-2;
    const auto n = shape.back();
    const auto x = leaf(shape, dtype), r = leaf(shape, dtype);
    const auto w = (torch::rand({n}) + 0.5).to(dtype).requires_grad_(true);
    const double eps = 1e-5;
    const auto [values, grads] = compare(
        {x, w}, [&](const auto& in) { return std::vector{mt::kernels::rms_norm(in[0], in[1], eps)}; },
        [&](const auto& in) { return std::vector{mt::kernels::composite::rms_norm(in[0], in[1], eps)}; });
    CHECK(values <= tolerance);
    CHECK(grads <= tolerance * 4);  // the weight's: a sum over rows
    const auto [add_values, add_grads] = compare(
        {x, r, w},
        [&](const auto& in) {
          auto [sum, y] = mt::kernels::add_rms_norm(in[0], in[1], in[2], eps);
          return std::vector{sum, y};
        },
        [&](const auto& in) {
          auto [sum, y] = mt::kernels::composite::add_rms_norm(in[0], in[1], in[2], eps);
          return std::vector{sum, y};
        });
    CHECK(add_values <= tolerance);
    CHECK(add_grads <= tolerance * 4);
  }
}

TEST_CASE("fused SwiGLU equals silu(gate) * up in values and gradients", "[kernels]") {
  torch::manual_seed(4);
  const auto threads = GENERATE(1, 2);
  WithThreads with(threads);
  const auto shape = GENERATE(std::vector<std::int64_t>{3, 37}, std::vector<std::int64_t>{4, 64, 384});
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    INFO("threads " << threads << ", dtype " << dtype << ", shape " << torch::IntArrayRef(shape));
    const auto [values, grads] = compare(
        {leaf(shape, dtype) * 4, leaf(shape, dtype)},
        [](const auto& in) { return std::vector{mt::kernels::swiglu(in[0], in[1])}; },
        [](const auto& in) { return std::vector{mt::kernels::composite::swiglu(in[0], in[1])}; });
    // silu's exp differs by an ulp between ATen's vectorised one and ours.
    CHECK(values <= (dtype == torch::kFloat ? 2e-6 : 2e-2));
    CHECK(grads <= (dtype == torch::kFloat ? 2e-6 : 5e-2));
  }
  // Gates where exp over- or underflows (the one-pass sigmoid clamps its argument): finite, and
  // the composite's values and gradients.
  const auto extreme = torch::tensor({-1e4f, -1000.0f, -100.0f, -88.5f, -87.0f, -1e-3f, 0.0f, 1e-3f, 87.0f, 88.5f,
                                      100.0f, 1000.0f, 1e4f, 3.0f, -3.0f, 0.5f, -0.5f});
  const auto [values, grads] = compare(
      {extreme, torch::randn({extreme.numel()})},
      [](const auto& in) { return std::vector{mt::kernels::swiglu(in[0], in[1])}; },
      [](const auto& in) { return std::vector{mt::kernels::composite::swiglu(in[0], in[1])}; });
  CHECK(values <= 2e-6);
  CHECK(grads <= 2e-6);
}

TEST_CASE("fused rotary embeddings equal x cos + rotate_half(x) sin on q and k, values and gradients", "[kernels]") {
  torch::manual_seed(5);
  const auto threads = GENERATE(1, 2);
  WithThreads with(threads);
  // head_dim 6 is all scalar tail; 40 half-vectors plus a tail; tables per row or shared.
  const auto [batch, seq, heads, kv_heads, dim, table_batch] =
      GENERATE(std::tuple{2, 5, 3, 1, 6, 1}, std::tuple{3, 64, 8, 4, 40, 3}, std::tuple{1, 7, 2, 2, 34, 1});
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    INFO("threads " << threads << ", dtype " << dtype << ", head_dim " << dim << ", table batch " << table_batch);
    // Tables whose two halves differ (real ones repeat), so that a swapped half shows.
    const auto angles = torch::rand({table_batch, seq, dim}) * 6.3;
    const auto cos = angles.cos().to(dtype), sin = angles.sin().to(dtype);
    const auto [values, grads] = compare(
        {leaf({batch, seq, heads, dim}, dtype), leaf({batch, seq, kv_heads, dim}, dtype)},
        [&](const auto& in) {
          auto [q, k] = mt::kernels::rotary(in[0], in[1], cos, sin);
          return std::vector{q, k};
        },
        [&](const auto& in) {
          auto [q, k] = mt::kernels::composite::rotary(in[0], in[1], cos, sin);
          return std::vector{q, k};
        });
    CHECK(values <= (dtype == torch::kFloat ? 1e-6 : 1e-2));
    CHECK(grads <= (dtype == torch::kFloat ? 1e-6 : 2e-2));
  }
}

TEST_CASE("rotary takes q and k as strided views, and refuses mismatched shapes", "[kernels]") {
  const auto projected = torch::randn({2, 4, 3 * 8});
  const auto q = projected.view({2, 4, 3, 8});
  const auto k = torch::randn({2, 4, 1, 8});
  const auto cos = torch::rand({1, 4, 8}), sin = torch::rand({1, 4, 8});
  auto [fq, fk] = mt::kernels::rotary(q, k, cos, sin);
  auto [cq, ck] = mt::kernels::composite::rotary(q, k, cos, sin);
  CHECK(max_difference(fq, cq) <= 1e-6);
  CHECK(max_difference(fk, ck) <= 1e-6);
  // Attention's layout seen through a transpose (as the gradients arrive): read in place.
  const auto heads_first = torch::randn({2, 3, 4, 8});
  auto [tq, tk] = mt::kernels::rotary(heads_first.transpose(1, 2), k, cos, sin);
  auto [tcq, tck] = mt::kernels::composite::rotary(heads_first.transpose(1, 2), k, cos, sin);
  CHECK(max_difference(tq, tcq) <= 1e-6);
  CHECK(tq.is_contiguous());
  // And the gradient read through that transpose.
  const auto grad_heads_first = torch::randn({2, 3, 4, 8});
  const auto leaf_q = torch::randn({2, 4, 3, 8}).requires_grad_(true);
  const auto leaf_c = leaf_q.detach().clone().requires_grad_(true);
  mt::kernels::rotary(leaf_q, k, cos, sin).first.backward(grad_heads_first.transpose(1, 2));
  mt::kernels::composite::rotary(leaf_c, k, cos, sin).first.backward(grad_heads_first.transpose(1, 2));
  CHECK(max_difference(leaf_q.grad(), leaf_c.grad()) <= 1e-6);
  CHECK_THROWS_WITH(mt::kernels::rotary(q, k, torch::rand({1, 5, 8}), torch::rand({1, 5, 8})),
                    Catch::Contains("rotary: tables of [1, 5, 8]"));
  CHECK_THROWS_WITH(mt::kernels::rotary(q, torch::randn({2, 4, 1, 6}), cos, sin),
                    Catch::Contains("differ in batch, seq or an even head_dim"));
}

TEST_CASE("fused cross entropy equals log_softmax and nll_loss summed, in values and gradients", "[kernels]") {
  torch::manual_seed(12);
  const auto threads = GENERATE(1, 2);
  WithThreads with(threads);
  const bool one_pass = mt::kernels::cpu_isa() == mt::kernels::Isa::avx512;
  // Vocabularies leaving every tail of 16 lanes, llama-tiny's and one past llama-6x384's; rows of
  // large, shifted and ordinary logits; a third of the targets ignored.
  std::vector<std::int64_t> vocabularies(33);
  std::iota(vocabularies.begin(), vocabularies.end(), 1);
  vocabularies.insert(vocabularies.end(), {264, 4103});
  for (const auto vocab : vocabularies)
    for (const std::int64_t rows : {1, 5, 67}) {
      for (const double scale : {1.0, 30.0}) {
        INFO("threads " << threads << ", " << rows << " rows, vocabulary " << vocab << ", logits x" << scale);
        const auto logits = (torch::randn({rows, vocab}) * scale + 40.0 * torch::randn({rows, 1}));
        auto targets = torch::randint(vocab, {rows});
        targets.masked_fill_(torch::rand({rows}) < 1.0 / 3, -100);
        const auto [values, grads] = compare(
            {logits}, [&](const auto& in) { return std::vector{mt::kernels::cross_entropy_sum(in[0], targets)}; },
            [&](const auto& in) { return std::vector{mt::kernels::composite::cross_entropy_sum(in[0], targets)}; });
        CHECK(values <= 2e-6);
        CHECK(grads <= 2e-6);
        // Against fp64: the sum of lse - x[target] over the rows kept.
        const auto exact = torch::nn::functional::cross_entropy(
            logits.to(torch::kDouble), targets,
            torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).reduction(torch::kSum));
        CHECK(max_difference(mt::kernels::cross_entropy_sum(logits, targets), exact) <= 2e-6);
      }
    }
  // Where AVX-512 runs, the one-pass kernel is what ran (its autograd node), not the composite.
  const auto x = torch::randn({4, 100}).requires_grad_(true);
  const auto loss = mt::kernels::cross_entropy_sum(x, torch::tensor({1, 2, 3, 4}, torch::kLong));
  CHECK((loss.grad_fn()->name().find("FusedCrossEntropy") != std::string::npos) == one_pass);
}

TEST_CASE("fused cross entropy: ignored rows, masked and extreme logits, NaN, bf16 logits, and bad targets",
          "[kernels]") {
  torch::manual_seed(13);
  const bool one_pass = mt::kernels::cpu_isa() == mt::kernels::Isa::avx512;
  const auto inf = std::numeric_limits<float>::infinity();
  // Every row ignored: a sum of 0 and a gradient of zeros.
  {
    const auto x = torch::randn({3, 20}).requires_grad_(true);
    const auto loss = mt::kernels::cross_entropy_sum(x, torch::full({3}, -100, torch::kLong));
    CHECK(loss.item<double>() == 0.0);
    loss.backward();
    CHECK(x.grad().abs().max().item<double>() == 0.0);
  }
  // Masked entries (-inf), logits far apart (e^x overflows and underflows), a target at each end.
  {
    const auto logits = torch::tensor(
        {{0.0f, -inf, 3.0f, -inf, 1.0f, 2.0f, -1.0f, 0.5f, 0.25f, -inf, 4.0f, 1.5f, 2.5f, -2.0f, 0.0f, 1.0f, 7.0f},
         {1e4f, -1e4f, 0.0f, 100.0f, -100.0f, 88.5f, -88.5f, 1e4f, 0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f,
          9999.0f}});
    const auto targets = torch::tensor({0, 16}, torch::kLong);
    const auto [values, grads] = compare(
        {logits}, [&](const auto& in) { return std::vector{mt::kernels::cross_entropy_sum(in[0], targets)}; },
        [&](const auto& in) { return std::vector{mt::kernels::composite::cross_entropy_sum(in[0], targets)}; });
    CHECK(values <= 2e-6);
    CHECK(grads <= 2e-6);
  }
  // A NaN logit makes its row's loss NaN, as the composite's does.
  {
    auto logits = torch::randn({2, 40});
    logits[1][7] = std::numeric_limits<float>::quiet_NaN();
    CHECK(std::isnan(mt::kernels::cross_entropy_sum(logits, torch::tensor({3, 5}, torch::kLong)).item<float>()));
  }
  // bf16 logits, as a bf16 model's head gives them: the fused loss of their fp32 copy, and the
  // gradient back to bf16, equal the composite's.
  {
    const auto logits = leaf({9, 77}, torch::kBFloat16);
    const auto targets = torch::randint(77, {9});
    const auto [values, grads] = compare(
        {logits},
        [&](const auto& in) {
          return std::vector{mt::llama::LlamaForCausalLMImpl::cross_entropy_sum(in[0], targets, true)};
        },
        [&](const auto& in) {
          return std::vector{mt::llama::LlamaForCausalLMImpl::cross_entropy_sum(in[0], targets, false)};
        });
    CHECK(values <= 2e-6);
    CHECK(grads <= 2e-2);  // one of bf16's 2^-8 steps where an fp32 ulp crosses a rounding boundary
  }
  // A masked entry's gradient is exactly 0, as e^-inf is.
  {
    const auto logits = torch::tensor({{1.0f, -inf, 2.0f, -inf, 0.5f}}).requires_grad_(true);
    mt::kernels::cross_entropy_sum(logits, torch::tensor({2}, torch::kLong)).backward();
    CHECK(logits.grad()[0][1].item<float>() == 0.0f);
    CHECK(logits.grad()[0][3].item<float>() == 0.0f);
  }
  // No rows; logits seen through a transpose; another ignored index, inside the vocabulary; a
  // graph kept and run backward twice.
  {
    CHECK(mt::kernels::cross_entropy_sum(torch::randn({0, 9}), torch::zeros({0}, torch::kLong)).item<double>() == 0);
    const auto strided = torch::randn({50, 6}).t();  // [6, 50], not contiguous
    const auto targets = torch::tensor({3, 0, 49, 3, 7, 3}, torch::kLong);
    const auto [values, grads] = compare(
        {strided}, [&](const auto& in) { return std::vector{mt::kernels::cross_entropy_sum(in[0], targets, 3)}; },
        [&](const auto& in) { return std::vector{mt::kernels::composite::cross_entropy_sum(in[0], targets, 3)}; });
    CHECK(values <= 2e-6);
    CHECK(grads <= 2e-6);
    const auto x = torch::randn({4, 30}).requires_grad_(true);
    const auto loss = mt::kernels::cross_entropy_sum(x, torch::tensor({1, 2, 3, 4}, torch::kLong));
    const auto first = torch::autograd::grad({loss}, {x}, {}, /*retain_graph=*/true).front();
    const auto second = torch::autograd::grad({loss}, {x}).front();
    CHECK(torch::equal(first, second));
    // A lazily negated view goes to the composite, which reads it negated.
    const auto negated = torch::randn({3, 20})._neg_view();
    const auto some = torch::tensor({1, 5, 19}, torch::kLong);
    CHECK(mt::kernels::cross_entropy_sum(negated, some).item<double>() ==
          mt::kernels::composite::cross_entropy_sum(negated.resolve_neg(), some).item<double>());
  }
  // A target outside the vocabulary is refused by row (the composite's ATen message differs).
  const auto bad = torch::tensor({1, -100, 4096, 2}, torch::kLong);
  if (one_pass)
    CHECK_THROWS_WITH(mt::kernels::cross_entropy_sum(torch::randn({4, 4096}), bad),
                      Catch::Contains("the target of row 2 is 4096, outside the vocabulary [0, 4096)"));
  else
    CHECK_THROWS(mt::kernels::cross_entropy_sum(torch::randn({4, 4096}), bad));
  CHECK_THROWS_WITH(mt::kernels::cross_entropy_sum(torch::randn({2, 8}), torch::tensor({-1, 0}, torch::kLong)),
                    Catch::Contains(one_pass ? "row 0 is -1," : "-1"));
}

TEST_CASE("few-rows linear equals x W^T + b for 2 to 8 rows on each instruction set this CPU runs", "[kernels]") {
  using mt::kernels::Isa;
  torch::manual_seed(11);
  c10::InferenceMode inference;
  const auto threads = GENERATE(1, 2);
  WithThreads with(threads);
  std::vector<Isa> isas;
  for (const auto isa : {Isa::avx2_fma, Isa::avx512})
    if (isa <= mt::kernels::cpu_isa()) isas.push_back(isa);
#if defined(__x86_64__)
  // Every x86-64 machine of the last decade has AVX2 and FMA, unless LibTorch's switch turns them off.
  if (std::getenv("ATEN_CPU_CAPABILITY") == nullptr) CHECK_FALSE(isas.empty());
#endif
  if (isas.empty()) {  // elsewhere the kernel is never taken
    CHECK_FALSE(mt::kernels::few_rows_linear_applies(torch::randn({4, 8}), torch::randn({3, 8}), {}));
    return;
  }
  // Widths leaving every tail of 16 and of 8 lanes, row counts odd and even, output rows odd and
  // even (the last weight row alone); x contiguous and a strided view of every third row.
  std::vector<std::int64_t> widths(40);
  std::iota(widths.begin(), widths.end(), 1);
  widths.push_back(768);
  for (const auto in : widths)
    for (const std::int64_t out : {1, 3, 64, 257})
      for (auto rows = mt::kernels::few_rows_minimum; rows <= mt::kernels::few_rows_limit; ++rows) {
        const auto w = torch::randn({out, in}), b = torch::randn({out});
        const auto strided = torch::randn({rows, 3, in}).select(1, 1);
        for (const auto& x : {torch::randn({rows, 1, in}), strided}) {
          const auto exact = at::linear(x.to(torch::kDouble), w.to(torch::kDouble), b.to(torch::kDouble));
          REQUIRE(mt::kernels::few_rows_linear_applies(x, w, b));
          for (const auto isa : isas) {
            INFO("isa " << static_cast<int>(isa) << ", " << rows << " rows, in " << in << ", out " << out
                        << (x.is_contiguous() ? "" : ", x strided"));
            // Memory of the output's size filled with NaN and freed first: an output element the
            // kernel skipped would show, not hold an earlier call's right answer.
            torch::full({rows, out}, std::numeric_limits<float>::quiet_NaN());
            const auto y = mt::kernels::few_rows_linear(x, w, b, isa);
            CHECK(y.sizes() == exact.sizes());
            CHECK(max_difference(y, exact) <= 1e-5);
            torch::full({rows, out}, std::numeric_limits<float>::quiet_NaN());
            CHECK(max_difference(mt::kernels::few_rows_linear(x, w, {}, isa), exact - b.to(torch::kDouble)) <= 1e-5);
          }
        }
      }
}

TEST_CASE("few-rows linear is taken only in inference mode where it applies, and at::linear elsewhere", "[kernels]") {
  const auto x = torch::randn({8, 32}), w = torch::randn({5, 32}), b = torch::randn({5});
  const bool available = mt::kernels::cpu_isa() != mt::kernels::Isa::none;
  {
    c10::InferenceMode inference;
    CHECK(mt::kernels::few_rows_linear_applies(x, w, b) == available);
    CHECK(mt::kernels::few_rows_linear_applies(x, w.detach().requires_grad_(true), b) == available);
    CHECK_FALSE(mt::kernels::few_rows_linear_applies(torch::randn({9, 32}), w, b));  // past few_rows_limit
    CHECK_FALSE(mt::kernels::few_rows_linear_applies(torch::randn({1, 32}), w, b));  // one row: LibTorch's GEMV
    CHECK_FALSE(mt::kernels::few_rows_linear_applies(x.to(torch::kBFloat16), w.to(torch::kBFloat16), {}));
    CHECK_FALSE(mt::kernels::few_rows_linear_applies(x, torch::randn({32, 5}).t(), b));  // w not contiguous
    CHECK_FALSE(mt::kernels::few_rows_linear_applies(x, w, torch::randn({4})));
    CHECK_FALSE(mt::kernels::few_rows_linear_applies(x, torch::randn({5, 31}), {}));
    CHECK_FALSE(mt::kernels::few_rows_linear_applies(x._neg_view(), w, b));  // negated lazily
    CHECK_THROWS_WITH(mt::kernels::few_rows_linear(torch::randn({9, 32}), w, b),
                      Catch::Contains("not for these tensors"));
    CHECK(max_difference(mt::kernels::linear(x._neg_view(), w, b), at::linear(-x, w, b)) <= 1e-5);
  }
  // Without gradients but outside inference mode (a checkpointed layer's forward, recomputed with
  // gradients in backward): LibTorch's GEMM both times, so both compute alike.
  {
    torch::NoGradGuard no_grad;
    CHECK_FALSE(mt::kernels::few_rows_linear_applies(x, w, b));
  }
  // Gradients asked for: LibTorch's GEMM, whose backward autograd knows.
  const auto trained = w.detach().requires_grad_(true);
  CHECK_FALSE(mt::kernels::few_rows_linear_applies(x, trained, b));
  const auto y = mt::kernels::linear(x, trained, b);
  CHECK(y.requires_grad());
  y.sum().backward();
  CHECK(trained.grad().defined());
  {
    c10::InferenceMode inference;
    CHECK(max_difference(mt::kernels::linear(x, trained, b), at::linear(x, w, b)) <= 1e-5);
  }
}

TEST_CASE("block causal attention equals LibTorch's scaled-dot-product attention in values and gradients",
          "[kernels]") {
  torch::manual_seed(7);
  const auto threads = GENERATE(1, 2);
  WithThreads with(threads);
  // {batch, query heads, key heads, sequence, head dim}: one position, a partial last block of
  // rows, grouped heads (3 and 4 a key head), head dims that leave a vector tail, several blocks.
  const auto shape = GENERATE(std::vector<std::int64_t>{2, 2, 2, 1, 16}, std::vector<std::int64_t>{2, 6, 2, 67, 24},
                              std::vector<std::int64_t>{1, 8, 2, 130, 64}, std::vector<std::int64_t>{3, 4, 4, 200, 33});
  const auto batch = shape[0], heads = shape[1], key_heads = shape[2], seq = shape[3], dim = shape[4];
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    INFO("threads " << threads << ", dtype " << dtype << ", shape " << torch::IntArrayRef(shape));
    // q as the model passes it, a [B, H, S, D] view of [B, S, H, D] rows; k contiguous; v with its
    // head dim strided (copied by the kernel).
    const auto [values, grads] = compare(
        {leaf({batch, seq, heads, dim}, dtype), leaf({batch, key_heads, seq, dim}, dtype),
         leaf({batch, key_heads, dim, seq}, dtype)},
        [](const auto& in) {
          return std::vector{mt::kernels::causal_attention(in[0].transpose(1, 2), in[1], in[2].transpose(2, 3))};
        },
        [](const auto& in) {
          return std::vector{
              mt::kernels::composite::causal_attention(in[0].transpose(1, 2), in[1], in[2].transpose(2, 3))};
        });
    // Sums of up to 200 products in another order than the flash kernel's.
    CHECK(values <= (dtype == torch::kFloat ? 1e-6 : 0.0));
    CHECK(grads <= (dtype == torch::kFloat ? 1e-6 : 0.0));
  }
}

TEST_CASE("block causal attention keeps its output in the output projection's layout, and is taken where it applies",
          "[kernels]") {
  const auto q = torch::randn({2, 3, 4, 16}).transpose(1, 2).requires_grad_(true);  // [B, H, S, D] of [B, S, H, D]
  const auto kv = torch::randn({2, 2, 3, 16});                                      // 2 key heads for 4 query heads
  const auto out = mt::kernels::causal_attention(q, kv, kv);
  CHECK(out.sizes() == q.sizes());
  // The [B, S, H, D] rows the output projection reads as [B, S, H * D] without a copy.
  CHECK(out.transpose(1, 2).is_contiguous());
  const auto second_order = [&] {
    return torch::autograd::grad({mt::kernels::causal_attention(q, kv, kv).sum()}, {q}, {}, true, true);
  };
  if (mt::kernels::cpu_isa() == mt::kernels::Isa::avx512)
    CHECK_THROWS_WITH(second_order(), Catch::Contains("causal_attention: the fused kernel's backward is not "
                                                      "differentiable"));
  else
    CHECK_NOTHROW(second_order());  // the composite: LibTorch's kernel
  // Queries and keys of different lengths (a cache's keys), or fp64: the composite, differentiable.
  const auto longer_keys = torch::randn({2, 2, 6, 16});
  CHECK(max_difference(mt::kernels::causal_attention(q, longer_keys, longer_keys),
                       mt::kernels::composite::causal_attention(q, longer_keys, longer_keys)) == 0);
  const auto q64 = q.detach().to(torch::kDouble).requires_grad_(true);
  CHECK_NOTHROW(torch::autograd::grad(
      {mt::kernels::causal_attention(q64, kv.to(torch::kDouble), kv.to(torch::kDouble)).sum()}, {q64}, {}, true, true));
}

TEST_CASE("a model with fused kernels gives the composite model's loss and gradients", "[kernels][model]") {
  torch::manual_seed(6);
  auto config = mt::llama::presets::llama_tiny;
  config.num_hidden_layers = 2;
  const auto threads = GENERATE(1, 2);
  WithThreads with(threads);
  mt::llama::LlamaForCausalLM fused(config), composite(config);
  mt::llama::init_weights(fused);
  {
    torch::NoGradGuard no_grad;
    for (auto& [name, leaf_module] : mt::weight_modules(*composite))
      leaf_module->weight.copy_(fused->named_parameters()[name + ".weight"]);
  }
  composite->use_fused_kernels(false);
  const auto ids = torch::randint(config.vocab_size, {3, 48});
  const auto loss_fused = fused->loss(ids, ids);
  const auto loss_composite = composite->loss(ids, ids);
  CHECK(std::abs(loss_fused.item<double>() - loss_composite.item<double>()) <= 1e-6);
  loss_fused.backward();
  loss_composite.backward();
  const auto composite_params = composite->named_parameters();
  for (const auto& item : fused->named_parameters()) {
    INFO(item.key());
    CHECK(max_difference(item.value().grad(), composite_params[item.key()].grad()) <= 1e-6);
  }
}

TEST_CASE("the fused kernels refuse a gradient of their gradient, and leave to the composite what they do not take",
          "[kernels]") {
  const auto x = torch::randn({4, 16}).requires_grad_(true);
  const auto w = torch::rand({16}).requires_grad_(true);
  const auto y = mt::kernels::rms_norm(x, w, 1e-5);
  CHECK_THROWS_WITH(torch::autograd::grad({y.sum()}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true),
                    Catch::Contains("rms_norm: the fused kernel's backward is not differentiable"));
  const auto gate = torch::randn({4, 16}).requires_grad_(true), up = torch::randn({4, 16});
  CHECK_THROWS_WITH(torch::autograd::grad({mt::kernels::swiglu(gate, up).sum()}, {gate}, {}, true, true),
                    Catch::Contains("swiglu: the fused kernel's backward is not differentiable"));
  if (mt::kernels::cpu_isa() == mt::kernels::Isa::avx512) {
    const auto logits = torch::randn({4, 16}).requires_grad_(true);
    const auto loss = mt::kernels::cross_entropy_sum(logits, torch::tensor({1, 2, 3, 4}, torch::kLong));
    CHECK_THROWS_WITH(torch::autograd::grad({loss}, {logits}, {}, true, true),
                      Catch::Contains("cross_entropy_sum: the fused kernel's backward is not differentiable"));
  }
  // A weight in another dtype than the rows (HF's fp32 weight on bf16 rows): the composite's promotion.
  const auto rows = torch::randn({3, 8}).to(torch::kBFloat16);
  const auto fp32_weight = torch::rand({8});
  CHECK(max_difference(mt::kernels::rms_norm(rows, fp32_weight, 1e-5),
                       mt::kernels::composite::rms_norm(rows, fp32_weight, 1e-5)) == 0);
  // Rows of width 0.
  CHECK(mt::kernels::rms_norm(torch::randn({3, 0}), torch::rand({0}), 1e-5).numel() == 0);
}
