// The examples' model kit (examples/common): each layer's gradients against finite
// differences, the convolution against a direct loop, the model's splits agreeing with
// each other, training lowering the loss, and the errors.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <stdexcept>
#include <vector>

#include "model_kit.hpp"

using namespace kit;

namespace {

std::vector<float> random_values(std::size_t n, std::uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// L = sum(y * r) for a fixed random r, so dL/dy = r. Compares the layer's dL/dx and
// dL/dparams with central differences of L (in double, from float forward passes).
void check_gradients(Layer& layer, std::size_t batch, std::uint64_t seed) {
  const std::size_t in = batch * layer.in_size(), out = batch * layer.out_size();
  std::vector<float> params(layer.param_count());
  std::mt19937_64 rng(seed);
  layer.init(params, rng);
  std::vector<float> x = random_values(in, seed + 1);
  const std::vector<float> r = random_values(out, seed + 2);
  std::vector<float> y(out);
  auto loss = [&] {
    layer.forward(params, x.data(), y.data(), batch);
    double l = 0;
    for (std::size_t i = 0; i < out; ++i) l += static_cast<double>(y[i]) * r[i];
    return l;
  };
  loss();
  std::vector<float> gx(in), grads(params.size(), 0.0f);
  layer.backward(params, x.data(), y.data(), r.data(), gx.data(), grads, batch);

  auto numeric = [&](float& v) {
    const float keep = v, h = 1e-2f;
    v = keep + h;
    const double up = loss();
    v = keep - h;
    const double down = loss();
    v = keep;
    return (up - down) / (2.0 * h);
  };
  for (std::size_t i = 0; i < in; i += 1 + in / 97) {  // a spread of inputs
    CAPTURE(i);
    CHECK(gx[i] == doctest::Approx(numeric(x[i])).epsilon(2e-3).scale(1.0));
  }
  for (std::size_t i = 0; i < params.size(); i += 1 + params.size() / 97) {
    CAPTURE(i);
    CHECK(grads[i] == doctest::Approx(numeric(params[i])).epsilon(2e-3).scale(1.0));
  }
  // Gradients are added to what is there, not written over it.
  std::vector<float> twice = grads;
  layer.forward(params, x.data(), y.data(), batch);
  layer.backward(params, x.data(), y.data(), r.data(), gx.data(), twice, batch);
  for (std::size_t i = 0; i < params.size(); ++i)
    REQUIRE(twice[i] == doctest::Approx(2 * grads[i]));
}

bspflow::Batch image_batch(std::size_t batch, std::uint64_t seed) {
  bspflow::Batch b;
  b.data = bspflow::Tensor(bspflow::DType::kFloat32, {batch, 784});
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> pixel(0, 255), label(0, 9);
  for (float& p : b.data.as<float>()) p = static_cast<float>(pixel(rng));
  for (std::size_t i = 0; i < batch; ++i) b.labels.push_back(label(rng));
  b.valid = batch;
  return b;
}

// Runs the stages forward on one batch; returns the head's output.
HeadOutput run_forward(bspflow::StageList& stages, const bspflow::Batch& batch) {
  std::vector<float> input, output;
  std::vector<std::vector<float>> saved(stages.size());
  for (std::uint32_t s = 0; s < stages.size(); ++s) {
    output.assign(stages[s]->output_elements(), 0.0f);
    bspflow::ForwardArgs a{batch, input, output, saved[s]};
    stages[s]->forward(bspflow::StageContext{s}, a);
    input = output;
  }
  return HeadOutput::from(output);
}

}  // namespace

TEST_CASE("layer gradients match finite differences") {
  SUBCASE("dense") {
    Dense d(7, 5);
    check_gradients(d, 3, 1);
  }
  SUBCASE("relu") {
    Relu r(11);
    check_gradients(r, 3, 2);
  }
  SUBCASE("conv 1 channel") {
    Conv2d c(Shape{8, 9, 1}, 4, 3);
    check_gradients(c, 2, 3);
  }
  SUBCASE("conv 3 channels") {
    Conv2d c(Shape{7, 6, 3}, 5, 5);
    check_gradients(c, 2, 4);
  }
  SUBCASE("max-pool") {
    MaxPool2 p(Shape{6, 8, 3});
    check_gradients(p, 2, 5);
  }
}

TEST_CASE("conv matches a direct convolution, channels last") {
  const Shape in{6, 7, 2};
  const std::size_t k = 3, oc = 4, batch = 2;
  Conv2d conv(in, oc, k);
  const Shape out = conv.output_shape();
  CHECK(out.height == 4);
  CHECK(out.width == 5);
  std::vector<float> params(conv.param_count());
  std::mt19937_64 rng(9);
  conv.init(params, rng);
  const std::vector<float> x = random_values(batch * in.size(), 10);
  std::vector<float> y(batch * out.size());
  conv.forward(params, x.data(), y.data(), batch);
  for (std::size_t n = 0; n < batch; ++n) {
    for (std::size_t oy = 0; oy < out.height; ++oy) {
      for (std::size_t ox = 0; ox < out.width; ++ox) {
        for (std::size_t o = 0; o < oc; ++o) {
          double acc = params[oc * k * k * in.channels + o];  // bias
          for (std::size_t ky = 0; ky < k; ++ky) {
            for (std::size_t kx = 0; kx < k; ++kx) {
              for (std::size_t c = 0; c < in.channels; ++c) {
                acc += params[o * k * k * in.channels + (ky * k + kx) * in.channels + c] *
                       x[n * in.size() + ((oy + ky) * in.width + ox + kx) * in.channels + c];
              }
            }
          }
          CHECK(y[n * out.size() + (oy * out.width + ox) * oc + o] ==
                doctest::Approx(acc).epsilon(1e-5));
        }
      }
    }
  }
}

TEST_CASE("max-pool picks each window's maximum and routes the gradient to it") {
  MaxPool2 p(Shape{2, 2, 1});
  const std::vector<float> x{1, 5, 3, 2};
  float y = 0;
  p.forward({}, x.data(), &y, 1);
  CHECK(y == 5);
  std::vector<float> gx(4, -1.0f);
  const float gy = 2;
  std::vector<float> none;
  p.backward({}, x.data(), &y, &gy, gx.data(), none, 1);
  CHECK(gx == std::vector<float>{0, 2, 0, 0});
}

TEST_CASE("the models' splits compute the same function") {
  for (Model m : {Model::kConv, Model::kMlp}) {
    CAPTURE(to_string(m));
    const bspflow::Batch batch = image_batch(6, 3);
    bspflow::StageList one = make_model(m, 1, 6, AdamW{});
    bspflow::StageList two = make_model(m, 2, 6, AdamW{});
    bspflow::StageList four = make_model(m, 4, 6, AdamW{});
    CHECK(one.size() == 1);
    CHECK(four.size() == 4);
    if (m == Model::kConv) {
      CHECK(four[0]->name() == "conv1");
      CHECK(four[1]->name() == "conv2");
      CHECK(two[0]->name() == "conv1+conv2");
      CHECK(four[0]->output_elements() == 6 * 12 * 12 * 10);
      CHECK(four[1]->output_elements() == 6 * 320);
    }
    const HeadOutput a = run_forward(one, batch), b = run_forward(two, batch),
                     c = run_forward(four, batch);
    CHECK(a.valid == 6);
    CHECK(a.loss_sum > 0);
    CHECK(b.loss_sum == doctest::Approx(a.loss_sum).epsilon(1e-5));
    CHECK(c.loss_sum == doctest::Approx(a.loss_sum).epsilon(1e-5));
    CHECK(c.correct == a.correct);
  }
  CHECK_THROWS_WITH_AS(make_model(Model::kConv, 3, 4, AdamW{}),
                       "the model splits into 1, 2 or 4 stages, not 3", std::invalid_argument);
}

TEST_CASE("training the conv net on one batch lowers its loss") {
  const bspflow::Batch batch = image_batch(8, 4);
  bspflow::StageList model = make_model(Model::kConv, 1, 8, AdamW{});
  bspflow::Stage& stage = *model[0];
  std::vector<float> out(HeadOutput::kElements), saved, grads(stage.gradient_elements());
  float first = 0, last = 0;
  for (int step = 0; step < 40; ++step) {
    bspflow::ForwardArgs f{batch, {}, out, saved};
    stage.forward(bspflow::StageContext{}, f);
    (step == 0 ? first : last) = out[0];
    std::fill(grads.begin(), grads.end(), 0.0f);
    bspflow::BackwardArgs b{batch, {}, saved, {}, {}, grads};
    stage.backward(bspflow::StageContext{}, b);
    stage.update(bspflow::StageContext{}, grads);
  }
  CHECK(last < 0.5f * first);
}

TEST_CASE("model kit errors name the problem") {
  CHECK_THROWS_WITH_AS(Conv2d(Shape{4, 4, 1}, 2, 5),
                       "Conv2d: a 5x5 kernel does not fit a 4x4x1 input", std::invalid_argument);
  CHECK_THROWS_WITH_AS(MaxPool2(Shape{5, 4, 1}),
                       "MaxPool2: the input must have even height and width, not 5x4",
                       std::invalid_argument);
  Layers layers;
  layers.push_back(std::make_unique<Dense>(4, 3));
  layers.push_back(std::make_unique<Relu>(5));
  CHECK_THROWS_WITH_AS(LayerStage("s", std::move(layers), 2, true, true, AdamW{}, 1),
                       "LayerStage 's': layer 1 takes 5 values, the layer before gives 3",
                       std::invalid_argument);
  bspflow::StageList model = make_model(Model::kMlp, 4, 2, AdamW{});
  CHECK_THROWS_WITH_AS(static_cast<LayerStage&>(*model[0]).set_parameters({1, 2}),
                       "LayerStage::set_parameters: 2 values, stage 'dense784' has 200960",
                       std::invalid_argument);
  const bspflow::Batch wrong = image_batch(3, 1);  // the stage expects 2 images
  std::vector<float> out(model[0]->output_elements()), saved;
  bspflow::ForwardArgs f{wrong, {}, out, saved};
  CHECK_THROWS_WITH_AS(model[0]->forward(bspflow::StageContext{}, f),
                       "batch holds 2352 values, the model expects 1568 (batch x 784)",
                       std::runtime_error);
}
