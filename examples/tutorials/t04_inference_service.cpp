// t04_inference_service: the flagship's conv net served as a latency-sensitive inference
// service. A Stream of four stages (one per block of the net) runs over 2 emulated IPUs
// (or 4); client threads send one Fashion-MNIST test image per request and get the 10
// logits back; the example measures the latency of every request, as a benchmark of a
// real service would.
//
//   t04_inference_service [--devices 2|4] [--train-steps N] [--train-seconds S]
//       [--weights FILE] [--save-weights FILE] [--requests N] [--warmup N] [--rate R]
//       [--seconds S] [--wait busy_spin|spin_then_park|park] [--hgrm BASE]
//       [--min-accuracy A] [--data-dir DIR]
//
// 1. The model. By default it trains the net briefly on the training images first: a
//    one-stage Pipeline on device 0, micro-batches of 40, one AdamW update each, until
//    --train-steps updates or --train-seconds have passed (about 80% test accuracy; the
//    flagship trains longer). --weights FILE loads trained weights instead, and
//    --save-weights FILE writes the weights served (format below).
// 2. The service. The net's four blocks (conv1, conv2, dense320, logits: the flagship's
//    split) become four stream stages. With 2 devices the conv blocks share device 0 and
//    the dense blocks device 1; with 4 each block has a device. Each stage calls its
//    layers' forward pass for one image (batch 1). A request is 784 pixel values (0..255,
//    row-major 28x28, as std::vector<float>); the first stage checks it (a wrong size, a
//    NaN or a value outside 0..255 is rejected with std::invalid_argument) and normalises
//    it as training did. The response is the 10 logits; the client takes the largest.
//    On a machine with 2 cores or more, core 0 is kept for the clients
//    (DeviceConfig::host_cores = {0}) and every client thread is pinned there.
// 3. Closed loop: one client sends --requests requests one at a time (each waits for its
//    response; after --warmup untimed ones). Halfway it sends one malformed request (783
//    values): it must come back as an error response (stage, device, request id, message)
//    while the service goes on.
// 4. Open loop: a pacing client sends --rate requests per second for --seconds whatever
//    the answers do, and takes the answers that came back between sends (a StreamClient is
//    one thread's). Latency is measured from the time a request was due to be sent, not from
//    when the pacer managed to send it, so a service that falls behind shows its queueing
//    delay (no coordinated omission). Every request sent must be answered.
// 5. For each client: p50, p99, p99.9 and max latency, the accuracy of the predictions,
//    a histogram on log-scale buckets, and the percentile distribution in HdrHistogram's
//    .hgrm text format (BASE_closed.hgrm, BASE_open.hgrm; plot them with HdrHistogram's
//    online plotter). The rows are what HdrHistogram's outputPercentileDistribution(out,
//    5, 1000.0) writes (5 ticks per half-distance to 100%, values in microseconds), computed
//    here from the exact samples; the Buckets/SubBuckets footer line gives the layout a
//    3-significant-digit HdrHistogram of nanoseconds reaching the largest sample would have.
// 6. The end: the stream is closed, it drains, and the StreamResult is printed. The
//    exit status is 1 if a request was lost, the malformed request was not answered with an
//    error, or a client's accuracy is below --min-accuracy (0.6 by default; 0 when the
//    dataset is missing and synthetic images with random labels stand in for it).
//
// Weights file (--weights, --save-weights): a short text header, then the raw weights:
//
//   bspflow-weights 1
//   model conv
//   stage conv1 260                  one line per stage: its name and its float32 count
//   stage conv2 5020
//   stage dense320 82176
//   stage logits 2570
//   data float32-le
//   <90026 little-endian IEEE-754 float32 values>
//
// The values follow the last header line directly: the stages in the order listed, each
// stage's layers in order, each layer's weights then its biases (the model kit's layout:
// LayerStage::parameters()). examples/common/weights_file.hpp reads and writes it: loading
// checks every header line, the stage names and sizes against the model, that exactly as
// many bytes as promised follow, and that every value is finite; an error names the file
// and what is wrong (tests/fuzz/fuzz_weights_file.cpp fuzzes the reader).
#include <CLI/CLI.hpp>

#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <bspflow/bspflow.hpp>
#include <bspflow/stream/stream.hpp>

#include "model_kit.hpp"
#include "weights_file.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using bspflow::Response;

constexpr const char* kName = "t04_inference_service";
constexpr std::size_t kSide = 28;
constexpr std::size_t kPixels = kSide * kSide;
constexpr std::size_t kClasses = 10;
constexpr std::size_t kTrainBatch = 40;               // images per AdamW update (as the flagship)
constexpr std::uint64_t kTrainIterations = 10;        // updates per Pipeline::run while training
constexpr std::chrono::microseconds kPacerSpin{100};  // the open-loop pacer spins this long

struct Settings {
  std::uint32_t devices = 2;
  std::uint64_t train_steps = 400;
  double train_seconds = 5;
  std::string weights;
  std::string save_weights;
  std::uint64_t requests = 2000;
  std::uint64_t warmup = 100;
  double rate = 5000;
  double seconds = 2;
  std::string wait = "spin_then_park";
  std::string hgrm = kName;
  double min_accuracy = 0.6;
  std::string data_dir = bspflow::idx::kDebianFashionMnistDir;
};

// ---- the model: the flagship's conv net as four blocks, one stream stage each ----

using Image = std::vector<float>;  // a request: 784 pixel values 0..255, row-major
template <std::size_t N>
using Activations = std::array<float, N>;    // what one block hands the next, per image
using Logits = std::array<float, kClasses>;  // a response

// One block: its layers, their parameters (each layer's in turn) and the buffers between
// its layers. A block runs on one device thread only (its layers keep scratch memory).
struct Block {
  std::string name;
  kit::Layers layers;
  std::vector<float> params;
  std::vector<std::vector<float>> between;  // output of every layer but the last

  std::size_t in_size() const { return layers.front()->in_size(); }
  std::size_t out_size() const { return layers.back()->out_size(); }
  static std::size_t param_count(const kit::Layers& layers) {
    std::size_t n = 0;
    for (const auto& l : layers) n += l->param_count();
    return n;
  }
  // y = the block applied to one image's x (batch 1).
  void forward(const float* x, float* y) {
    std::size_t at = 0;
    for (std::size_t l = 0; l < layers.size(); ++l) {
      float* out = l + 1 == layers.size() ? y : between[l].data();
      const std::size_t n = layers[l]->param_count();
      layers[l]->forward(std::span<const float>(params).subspan(at, n), x, out, 1);
      at += n;
      x = out;
    }
  }
};

Block make_block(std::string name, kit::Layers layers) {
  Block b{std::move(name), std::move(layers), {}, {}};
  b.params.assign(Block::param_count(b.layers), 0.0f);
  for (std::size_t l = 0; l + 1 < b.layers.size(); ++l)
    b.between.emplace_back(b.layers[l]->out_size());
  return b;
}

// conv 5x5 1->10, max-pool, ReLU | conv 5x5 10->20, max-pool, ReLU | dense 320->256, ReLU |
// dense 256->10: kit::make_model(Model::kConv, ...) with the same layers in the same order,
// so the trained parameters copy over as they are.
std::vector<Block> make_net() {
  std::vector<Block> net;
  kit::Layers l;
  auto conv1 = std::make_unique<kit::Conv2d>(kit::Shape{kSide, kSide, 1}, 10, 5);
  const kit::Shape c1 = conv1->output_shape();  // 24x24x10
  l.push_back(std::move(conv1));
  l.push_back(std::make_unique<kit::MaxPool2>(c1));  // 12x12x10
  l.push_back(std::make_unique<kit::Relu>(c1.size() / 4));
  net.push_back(make_block("conv1", std::move(l)));
  l.clear();
  auto conv2 = std::make_unique<kit::Conv2d>(kit::Shape{12, 12, 10}, 20, 5);
  const kit::Shape c2 = conv2->output_shape();  // 8x8x20
  l.push_back(std::move(conv2));
  l.push_back(std::make_unique<kit::MaxPool2>(c2));  // 4x4x20 = 320
  l.push_back(std::make_unique<kit::Relu>(c2.size() / 4));
  net.push_back(make_block("conv2", std::move(l)));
  l.clear();
  l.push_back(std::make_unique<kit::Dense>(320, 256));
  l.push_back(std::make_unique<kit::Relu>(256));
  net.push_back(make_block("dense320", std::move(l)));
  l.clear();
  l.push_back(std::make_unique<kit::Dense>(256, kClasses));
  net.push_back(make_block("logits", std::move(l)));
  return net;
}

std::size_t param_count(const std::vector<Block>& net) {
  std::size_t n = 0;
  for (const Block& b : net) n += b.params.size();
  return n;
}

// The flat parameter vector of the whole net (kit::LayerStage's layout) into the blocks.
void set_parameters(std::vector<Block>& net, const std::vector<float>& flat) {
  if (flat.size() != param_count(net)) {
    throw std::runtime_error("the trained model has " + std::to_string(flat.size()) +
                             " parameters, the served one " + std::to_string(param_count(net)));
  }
  auto at = flat.begin();
  for (Block& b : net) {
    std::copy(at, at + static_cast<std::ptrdiff_t>(b.params.size()), b.params.begin());
    at += static_cast<std::ptrdiff_t>(b.params.size());
  }
}

// The first stage's check: what a service must do with input from outside.
void check_image(const Image& x) {
  if (x.size() != kPixels) {
    throw std::invalid_argument("an image has " + std::to_string(kPixels) +
                                " pixel values (28x28), this request has " +
                                std::to_string(x.size()));
  }
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (!(x[i] >= 0.0f && x[i] <= 255.0f)) {  // also false for NaN
      throw std::invalid_argument(
          "pixel " + std::to_string(i) + " (row " + std::to_string(i / kSide) + ", column " +
          std::to_string(i % kSide) + ") is " + std::to_string(x[i]) + "; pixel values are 0..255");
    }
  }
}

// ---- weights files (the format: examples/common/weights_file.hpp) ----

constexpr std::string_view kModel = "conv";

std::vector<kit::WeightsSection> sections_of(std::vector<Block>& net) {
  std::vector<kit::WeightsSection> sections;
  for (Block& b : net) sections.push_back({b.name, b.params});
  return sections;
}

// ---- data ----

struct Data {
  std::optional<bspflow::TensorDataset> train, test;
  bool real = true;
};

Data load_data(const std::string& dir, bool need_train) {
  Data d;
  const std::filesystem::path p(dir);
  const bool present = std::filesystem::exists(p / "t10k-images-idx3-ubyte.gz") ||
                       std::filesystem::exists(p / "t10k-images-idx3-ubyte");
  if (present) {
    d.test = bspflow::mnist_dataset(dir, "t10k");
    if (need_train) d.train = bspflow::mnist_dataset(dir, "train");
    return d;
  }
  std::printf(
      "note: Fashion-MNIST is not in %s (Debian: apt install dataset-fashion-mnist); using "
      "synthetic "
      "images with random labels instead, so the accuracy means nothing\n",
      dir.c_str());
  d.real = false;
  const auto synthetic = [](std::size_t size, std::uint64_t seed) {
    bspflow::SyntheticDataset::Config c;
    c.size = size;
    c.spec = bspflow::SampleSpec{bspflow::DType::kUint8, {1, kSide, kSide}};
    c.seed = seed;
    return bspflow::TensorDataset::materialize(bspflow::SyntheticDataset(c));
  };
  d.test = synthetic(10000, 2);
  if (need_train) d.train = synthetic(20000, 1);
  return d;
}

Image image_of(const bspflow::TensorDataset& ds, std::size_t i) {
  const auto bytes = ds.bytes().subspan(i * kPixels, kPixels);
  Image x(kPixels);
  for (std::size_t k = 0; k < kPixels; ++k)
    x[k] = static_cast<float>(std::to_integer<std::uint8_t>(bytes[k]));
  return x;
}

std::size_t predicted(const Logits& l) {
  return static_cast<std::size_t>(std::max_element(l.begin(), l.end()) - l.begin());
}

// ---- training: a one-stage Pipeline on device 0 ----

std::vector<float> train(bspflow::DeviceGroup& devices, const bspflow::TensorDataset& data,
                         const Settings& st) {
  const kit::AdamW adamw;  // lr 0.001, as the flagship
  bspflow::PipelineConfig cfg;
  bspflow::Pipeline pipe(devices, cfg, [&](std::uint32_t) {
    return kit::make_model(kit::Model::kConv, 1, kTrainBatch, adamw);
  });
  bspflow::LoaderConfig lc;
  lc.batch_size = kTrainBatch;
  lc.shuffle = true;
  lc.seed = 42;
  lc.mode = bspflow::LoaderMode::kAsync;
  lc.num_workers = 1;
  lc.output_dtype = bspflow::DType::kFloat32;
  bspflow::DataLoader loader(bspflow::StepShape{kTrainIterations, 1, 1}, data, lc);
  bspflow::InfeedQueue<bspflow::Batch> infeed(bspflow::InfeedConfig{1, 2 * kTrainIterations, 2});
  bspflow::OutfeedQueue<std::vector<float>> outfeed(
      bspflow::OutfeedConfig{1, bspflow::OutputMode::all(), 0});
  auto producer = infeed.make_producer();

  std::printf("training the conv net on %zu images: %llu AdamW steps of %zu images", data.size(),
              static_cast<unsigned long long>(st.train_steps), kTrainBatch);
  if (st.train_seconds > 0) std::printf(" (at most %.1f s)", st.train_seconds);
  std::printf("\n");
  const auto t0 = Clock::now();
  const auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  std::uint64_t done = 0, next_report = 100;
  double loss = 0, correct = 0, valid = 0;  // since the last report
  while (done < st.train_steps && (st.train_seconds <= 0 || elapsed() < st.train_seconds)) {
    if (!loader.feed_next(producer) && !loader.feed_next(producer)) {  // false: a new epoch starts
      throw std::runtime_error("the training data ran out");
    }
    const std::uint64_t n = std::min(kTrainIterations, st.train_steps - done);
    const bspflow::PipelineResult r = pipe.run(infeed, n, &outfeed);
    if (!r.completed()) throw std::runtime_error("training stopped: " + r.message);
    for (const auto& e : outfeed.drain()) {
      const auto h = kit::HeadOutput::from(e.value);
      loss += h.loss_sum;
      correct += h.correct;
      valid += h.valid;
    }
    done += n;
    if (done >= next_report || done == st.train_steps) {
      std::printf(
          "  step %5llu  loss %.3f  accuracy %5.1f%% (training images since the last line)  %.1f "
          "s\n",
          static_cast<unsigned long long>(done), loss / std::max(valid, 1.0),
          100 * correct / std::max(valid, 1.0), elapsed());
      loss = correct = valid = 0;
      next_report = done + 100;
    }
  }
  if (done < st.train_steps) {
    std::printf("  stopped after %llu steps: --train-seconds %.1f passed\n",
                static_cast<unsigned long long>(done), st.train_seconds);
  }
  return static_cast<kit::LayerStage&>(pipe.stage(0, 0)).parameters();
}

// ---- latency figures ----

// The value at percentile p of sorted samples, as HdrHistogram's getValueAtPercentile: the
// smallest sample with at least p% of the samples at or below it.
std::int64_t at_percentile(const std::vector<std::int64_t>& s, double p) {
  const auto rank = static_cast<std::size_t>(std::ceil(p / 100.0 * static_cast<double>(s.size())));
  return s[std::clamp<std::size_t>(rank, 1, s.size()) - 1];
}

double us(std::int64_t ns) {
  return static_cast<double>(ns) / 1e3;
}

void print_latency(const std::vector<std::int64_t>& s) {
  double sum = 0;
  for (std::int64_t v : s) sum += static_cast<double>(v);
  std::printf(
      "  latency: p50 %.1f us, p99 %.1f us, p99.9 %.1f us, max %.1f us (mean %.1f us, %zu "
      "requests)\n",
      us(at_percentile(s, 50)), us(at_percentile(s, 99)), us(at_percentile(s, 99.9)), us(s.back()),
      sum / 1e3 / static_cast<double>(s.size()), s.size());
}

// Counts on log-scale buckets: edges at powers of sqrt(2), 2 or 4 microseconds, whichever
// gives about 10 rows from the fastest sample to the slowest.
void print_histogram(const std::vector<std::int64_t>& s) {
  const double lo = std::max(us(s.front()), 0.001), hi = std::max(us(s.back()), lo);
  const double octaves = std::log2(hi / lo);
  const double ratio = octaves < 4 ? std::sqrt(2.0) : octaves > 14 ? 4.0 : 2.0;
  const double base = std::pow(ratio, std::floor(std::log(lo) / std::log(ratio) + 1e-9));
  const auto bucket = [&](double v) {
    return static_cast<std::size_t>(std::floor(std::log(v / base) / std::log(ratio)));
  };
  const std::size_t rows = bucket(hi) + 1;
  std::vector<std::size_t> count(rows, 0);
  for (std::int64_t v : s) ++count[std::min(bucket(std::max(us(v), lo)), rows - 1)];
  const std::size_t most = *std::max_element(count.begin(), count.end());
  std::printf("  %20s %7s\n", "latency (us)", "count");
  for (std::size_t r = 0; r < rows; ++r) {
    const double from = base * std::pow(ratio, static_cast<double>(r)), to = from * ratio;
    const std::size_t bar = count[r] == 0 ? 0 : std::max<std::size_t>(1, 50 * count[r] / most);
    std::printf("  [%8.1f, %8.1f) %7zu %s\n", from, to, count[r], std::string(bar, '#').c_str());
  }
}

// The percentile distribution as HdrHistogram's outputPercentileDistribution(out, 5, 1000.0)
// prints it (Java, text form), from the exact samples in nanoseconds.
void write_hgrm(const std::string& path, const std::vector<std::int64_t>& s) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr)
    throw std::runtime_error(path +
                             ": cannot write the percentile distribution: " + std::strerror(errno));
  std::fprintf(f, "%12s %14s %10s %14s\n\n", "Value", "Percentile", "TotalCount",
               "1/(1-Percentile)");
  const double n = static_cast<double>(s.size());
  const auto row = [&](std::int64_t v, double level, std::size_t total) {
    if (level != 100.0) {
      std::fprintf(f, "%12.3f %2.12f %10zu %14.2f\n", us(v), level / 100.0, total,
                   1 / (1.0 - level / 100.0));
    } else {
      std::fprintf(f, "%12.3f %2.12f %10zu\n", us(v), level / 100.0, total);
    }
  };
  // HdrHistogram's PercentileIterator: levels from 0%, 5 ticks per half-distance to 100%;
  // a row at each level for the smallest value with that share of samples at or below it
  // (one value may get several rows), then a last row at 100%.
  double level = 0;
  for (std::size_t pos = 0; pos < s.size();) {
    const std::int64_t v = s[pos];
    const auto total =
        static_cast<std::size_t>(std::upper_bound(s.begin(), s.end(), v) - s.begin());
    bool last = false;
    while (!last && 100.0 * static_cast<double>(total) / n >= level) {
      row(v, level, total);
      const auto ticks =
          5 * static_cast<long long>(std::pow(
                  2, static_cast<long long>(std::log(100.0 / (100.0 - level)) / std::log(2)) + 1));
      level += 100.0 / static_cast<double>(ticks);
      if (total == s.size()) {
        row(v, 100.0, total);
        last = true;
      }
    }
    if (last) break;
    pos = total;
  }
  double mean = 0, dev = 0;
  for (std::int64_t v : s) mean += static_cast<double>(v);
  mean /= n;
  for (std::int64_t v : s) dev += (static_cast<double>(v) - mean) * (static_cast<double>(v) - mean);
  // An HdrHistogram with 3 significant digits over 1 ns .. the largest sample: 2048 sub-
  // buckets, and buckets doubling from 2048 ns until one holds the largest sample.
  int buckets = 1;
  for (std::int64_t reach = 2048; reach <= s.back(); reach <<= 1) ++buckets;
  std::fprintf(f, "#[Mean    = %12.3f, StdDeviation   = %12.3f]\n", mean / 1e3,
               std::sqrt(dev / n) / 1e3);
  std::fprintf(f, "#[Max     = %12.3f, Total count    = %12zu]\n", us(s.back()), s.size());
  std::fprintf(f, "#[Buckets = %12d, SubBuckets     = %12d]\n", buckets, 2048);
  if (std::fclose(f) != 0)
    throw std::runtime_error(path + ": cannot write the percentile distribution");
}

struct ClientReport {
  std::vector<std::int64_t> latency_ns;  // answered requests only
  std::uint64_t sent = 0, answered = 0, correct = 0, unexpected = 0;
  double seconds = 0;
};

// Prints a client's figures; returns false if its accuracy is below the minimum.
bool report(const char* title, ClientReport& c, const std::string& hgrm, double min_accuracy) {
  std::printf("\n%s\n", title);
  std::sort(c.latency_ns.begin(), c.latency_ns.end());
  const double accuracy =
      c.answered ? static_cast<double>(c.correct) / static_cast<double>(c.answered) : 0;
  std::printf("  %llu sent, %llu answered in %.2f s (%.0f requests/s)\n",
              static_cast<unsigned long long>(c.sent), static_cast<unsigned long long>(c.answered),
              c.seconds, static_cast<double>(c.answered) / c.seconds);
  if (c.latency_ns.empty()) return false;
  print_latency(c.latency_ns);
  std::printf("  accuracy: %.2f%% (%llu of %llu predictions match the label)\n", 100 * accuracy,
              static_cast<unsigned long long>(c.correct),
              static_cast<unsigned long long>(c.answered));
  print_histogram(c.latency_ns);
  if (!hgrm.empty()) {
    write_hgrm(hgrm, c.latency_ns);
    std::printf("  percentile distribution: %s\n", hgrm.c_str());
  }
  if (accuracy < min_accuracy) {
    std::fprintf(stderr, "%s: accuracy %.2f%% is below --min-accuracy %.2f%%\n", title,
                 100 * accuracy, 100 * min_accuracy);
    return false;
  }
  return true;
}

// Client threads run on core 0 when it is reserved for them.
void pin_client(bool reserved) {
  if (reserved && !bspflow::Topology::get().pin_current_thread(0)) {
    std::printf("note: could not pin a client thread to core 0 (no hwloc?)\n");
  }
}

bspflow::WaitPolicy wait_policy(const std::string& name) {
  if (name == "busy_spin") return bspflow::WaitPolicy::busy_spin();
  if (name == "park") return bspflow::WaitPolicy::park();
  return bspflow::WaitPolicy::spin_then_park();
}

int run(Settings st, bool min_accuracy_given) {
  // The machine: keep core 0 for the clients when there is another core for the devices.
  const bspflow::Topology& topo = bspflow::Topology::get();
  const bool reserve = topo.cores() >= 2;
  bspflow::DeviceConfig dc;
  if (reserve) dc.host_cores = {0};
  bspflow::DeviceGroup devices(st.devices, dc);

  // The model: trained here, or loaded.
  const Data data = load_data(st.data_dir, st.weights.empty());
  if (!data.real && !min_accuracy_given) st.min_accuracy = 0;
  std::vector<Block> net = make_net();
  if (st.weights.empty()) {
    set_parameters(net, train(devices, *data.train, st));
  } else {
    kit::load_weights_file(st.weights, kModel, sections_of(net));
    std::printf("weights: %s (%zu values)\n", st.weights.c_str(), param_count(net));
  }
  if (!st.save_weights.empty()) {
    kit::save_weights_file(st.save_weights, kModel, sections_of(net));
    std::printf("weights saved to %s\n", st.save_weights.c_str());
  }

  // The service: four stages; with 2 devices each device runs two consecutive ones.
  const std::array<std::uint32_t, 4> on = st.devices == 4
                                              ? std::array<std::uint32_t, 4>{0, 1, 2, 3}
                                              : std::array<std::uint32_t, 4>{0, 0, 1, 1};
  bspflow::StreamConfig sc;
  sc.wait = wait_policy(st.wait);
  auto stream = bspflow::StreamBuilder<Image>(devices, sc)
                    .stage(
                        "conv1",
                        [&b = net[0]](Image x) {
                          check_image(x);
                          for (float& v : x) v = v * (2.0f / 255.0f) - 1.0f;  // as in training
                          Activations<1440> y;
                          b.forward(x.data(), y.data());
                          return y;
                        },
                        on[0])
                    .stage(
                        "conv2",
                        [&b = net[1]](Activations<1440> x) {
                          Activations<320> y;
                          b.forward(x.data(), y.data());
                          return y;
                        },
                        on[1])
                    .stage(
                        "dense320",
                        [&b = net[2]](Activations<320> x) {
                          Activations<256> y;
                          b.forward(x.data(), y.data());
                          return y;
                        },
                        on[2])
                    .stage(
                        "logits",
                        [&b = net[3]](Activations<256> x) {
                          Logits y;
                          b.forward(x.data(), y.data());
                          return y;
                        },
                        on[3])
                    .build();
  if (net[0].out_size() != 1440 || net[1].out_size() != 320 || net[2].out_size() != 256 ||
      net[3].out_size() != kClasses) {
    throw std::logic_error("the blocks' sizes do not match the stages' types");
  }

  std::printf(
      "\nserving on %u devices (%u cores%s):\n", st.devices, topo.cores(),
      reserve ? "; core 0 kept for the client threads" : "; clients and devices share the core");
  for (std::uint32_t d = 0; d < st.devices; ++d) {
    const bspflow::Placement& p = devices[d].placement();
    std::string stages;
    for (std::uint32_t s = 0; s < stream.stages(); ++s) {
      if (stream.device_of(s) == d) stages += (stages.empty() ? "" : ", ") + stream.stage_name(s);
    }
    const bspflow::WaitPolicy w = p.wait_policy(sc.wait);
    std::printf(
        "  device %u: %s%s  stages %s  waits %s%s\n", d,
        p.core ? ("core " + std::to_string(*p.core)).c_str() : "unpinned",
        p.sharing > 1 ? (" (shared by " + std::to_string(p.sharing) + " devices)").c_str() : "",
        stages.c_str(), bspflow::to_string(w.strategy),
        p.shares_core() ? " (adjusted: it shares its core)" : "");
  }

  stream.start();
  const bspflow::TensorDataset& test = *data.test;
  const auto labels = test.labels();
  bool ok = true;

  // ---- closed loop: one request at a time ----
  ClientReport closed;
  bool malformed_answered = false;
  std::thread closed_client([&, client = stream.client()]() mutable {
    pin_client(reserve);
    const std::uint64_t total = st.warmup + st.requests;
    Clock::time_point first{};
    for (std::uint64_t i = 0; i < total; ++i) {
      if (i == st.warmup + st.requests / 2) {  // one malformed request, halfway
        const bspflow::Submission s = client.push(Image(kPixels - 1, 0.0f));
        const auto answer = s ? client.pop() : std::nullopt;
        if (!answer) break;
        const Response<Logits>& r = *answer;
        if (r.ok() || !(r.id == s.id)) {
          std::printf("\nthe malformed request was %s\n",
                      r.ok() ? "answered with logits, not an error" : "answered out of order");
        } else {
          bool invalid_argument = false;
          try {
            std::rethrow_exception(r.error->cause);
          } catch (const std::invalid_argument&) {
            invalid_argument = true;
          } catch (...) {
          }
          malformed_answered = invalid_argument;
          std::printf(
              "\nmalformed request (%zu values) answered with an error, the service goes on:\n"
              "  stage %u '%s', device %u, request %llu of client %u%s\n  %s\n",
              kPixels - 1, r.error->stage, r.error->stage_name.c_str(), r.error->device,
              static_cast<unsigned long long>(r.error->id.sequence), r.error->id.client,
              invalid_argument ? ", std::invalid_argument" : " (not std::invalid_argument!)",
              r.error->message.c_str());
        }
      }
      const std::size_t image = i % test.size();
      Image x = image_of(test, image);
      const auto t0 = Clock::now();
      if (i == st.warmup) first = t0;
      const bspflow::Submission s = client.push(std::move(x));
      const auto answer = s ? client.pop() : std::nullopt;
      const auto t1 = Clock::now();
      if (!answer) break;  // the stream stopped
      if (i < st.warmup) continue;
      ++closed.sent;
      const Response<Logits>& r = *answer;
      if (!r.ok() || !(r.id == s.id)) {
        ++closed.unexpected;
        continue;
      }
      ++closed.answered;
      closed.latency_ns.push_back(
          std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count());
      closed.correct += predicted(*r.value) == static_cast<std::size_t>(labels[image]) ? 1 : 0;
      closed.seconds = std::chrono::duration<double>(t1 - first).count();
    }
  });
  closed_client.join();

  // ---- open loop: a fixed rate, whatever the answers do ----
  // One thread sends each request when it is due and, between sends, takes the answers that
  // have come back: a StreamClient is one thread's, and a second thread on the client's core
  // would be time-sliced with the sender.
  ClientReport open;
  const auto due = static_cast<std::uint64_t>(std::llround(st.rate * st.seconds));
  const double period_ns = 1e9 / st.rate;
  std::vector<std::int64_t> latency_by_id(due, -1), lag_ns;
  lag_ns.reserve(due);
  const auto start = Clock::now() + std::chrono::milliseconds(2);
  const auto due_at = [&](std::uint64_t i) {
    return start + std::chrono::nanoseconds(std::llround(static_cast<double>(i) * period_ns));
  };
  std::thread pacer([&, client = stream.client()]() mutable {
    pin_client(reserve);
#ifdef __linux__
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);  // wake when asked, not up to 50 us later
#endif
    const auto take = [&](const Response<Logits>& r) {
      const auto now = Clock::now();
      if (r.id.sequence >= due || !r.ok() || latency_by_id[r.id.sequence] >= 0) {
        ++open.unexpected;
        return;
      }
      latency_by_id[r.id.sequence] =
          std::chrono::duration_cast<std::chrono::nanoseconds>(now - due_at(r.id.sequence)).count();
      const std::size_t image = (st.requests + r.id.sequence) % test.size();
      open.correct += predicted(*r.value) == static_cast<std::size_t>(labels[image]) ? 1 : 0;
      open.seconds = std::chrono::duration<double>(now - start).count();
    };
    for (std::uint64_t i = 0; i < due; ++i) {
      Image x = image_of(test, (st.requests + i) % test.size());
      // A sleep wakes tens of microseconds late (more on a VM): sleep until just before the
      // request is due, then take answers until it is. Accurate sends cost CPU: at 5000
      // requests/s the wait takes about half of the pacer's core.
      const auto when = due_at(i);
      while (auto r = client.try_pop()) take(*r);
      std::this_thread::sleep_until(when - kPacerSpin);
      while (Clock::now() < when) {
        if (auto r = client.try_pop()) take(*r);
      }
      lag_ns.push_back(
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - due_at(i)).count());
      if (!client.push(std::move(x))) break;  // refused: the stream closed, or too many unpopped
      ++open.sent;
    }
    while (auto r = client.pop()) take(*r);  // the rest of the answers
  });
  pacer.join();
  stream.close();  // no more requests: the stream answers what it has, then ends
  const bspflow::StreamResult result = stream.wait();

  for (std::uint64_t i = 0; i < open.sent; ++i) {
    if (latency_by_id[i] >= 0) open.latency_ns.push_back(latency_by_id[i]);
  }
  open.answered = open.latency_ns.size();
  const std::uint64_t lost = open.sent - open.answered;

  // ---- the figures ----
  std::string base = st.hgrm;
  if (base.size() > 5 && base.ends_with(".hgrm")) base.resize(base.size() - 5);
  ok &= report("closed loop: one request at a time", closed,
               base.empty() ? "" : base + "_closed.hgrm", st.min_accuracy);
  char title[160];
  std::snprintf(title, sizeof title,
                "open loop: %.0f requests/s offered for %.2f s (latency from when each was due)",
                st.rate, st.seconds);
  ok &= report(title, open, base.empty() ? "" : base + "_open.hgrm", st.min_accuracy);
  if (!lag_ns.empty()) {
    std::sort(lag_ns.begin(), lag_ns.end());
    std::printf(
        "  pacer: sent p50 %.1f us, p99 %.1f us, max %.1f us after each request was due (included "
        "above)\n",
        us(at_percentile(lag_ns, 50)), us(at_percentile(lag_ns, 99)), us(lag_ns.back()));
  }
  std::printf("  lost: %llu\n", static_cast<unsigned long long>(lost));

  std::printf("\nstream: %s (%.2f s)\n", result.message.c_str(),
              std::chrono::duration<double>(result.elapsed).count());
  if (lost != 0 || open.unexpected != 0 || closed.unexpected != 0 || closed.sent != st.requests ||
      open.sent != due) {
    std::fprintf(stderr,
                 "requests went missing or came back wrong: %llu lost, %llu unexpected responses, "
                 "%llu of %llu "
                 "closed-loop and %llu of %llu open-loop requests sent\n",
                 static_cast<unsigned long long>(lost),
                 static_cast<unsigned long long>(open.unexpected + closed.unexpected),
                 static_cast<unsigned long long>(closed.sent),
                 static_cast<unsigned long long>(st.requests),
                 static_cast<unsigned long long>(open.sent), static_cast<unsigned long long>(due));
    ok = false;
  }
  if (!malformed_answered || result.errors != 1) {
    std::fprintf(stderr,
                 "the malformed request should get the one error response (std::invalid_argument); "
                 "errors: %llu\n",
                 static_cast<unsigned long long>(result.errors));
    ok = false;
  }
  if (!result.drained() || result.unanswered != 0 || result.answered != result.accepted) {
    std::fprintf(stderr, "the stream did not drain cleanly: %s\n", result.message.c_str());
    ok = false;
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Settings st;
  CLI::App app{
      "t04_inference_service: serve the flagship's conv net with a Stream and measure request "
      "latency"};
  app.option_defaults()->always_capture_default();  // --help shows every option's default
  app.add_option("--devices", st.devices,
                 "devices to serve on (the net's 4 stages split over them)")
      ->check(CLI::IsMember({2, 4}));
  app.add_option("--train-steps", st.train_steps,
                 "AdamW steps (40 images each) to train before serving")
      ->check(CLI::Range(1, 1000000));
  app.add_option("--train-seconds", st.train_seconds, "stop training after this long (0: no limit)")
      ->check(CLI::Range(0.0, 86400.0));
  app.add_option("--weights", st.weights,
                 "load the weights from FILE instead of training (default: none)");
  app.add_option("--save-weights", st.save_weights,
                 "write the weights served to FILE (default: none)");
  app.add_option("--requests", st.requests, "closed-loop requests (one at a time), timed")
      ->check(CLI::Range(2, 100000000));
  app.add_option("--warmup", st.warmup, "closed-loop requests sent first, not timed")
      ->check(CLI::Range(0, 100000000));
  app.add_option("--rate", st.rate, "open-loop offered load, requests/s")
      ->check(CLI::Range(1.0, 1e7));
  app.add_option("--seconds", st.seconds, "open-loop duration, seconds")
      ->check(CLI::Range(0.001, 3600.0));
  app.add_option("--wait", st.wait, "how devices wait for the next request")
      ->check(CLI::IsMember({"busy_spin", "spin_then_park", "park"}));
  app.add_option("--hgrm", st.hgrm, "write BASE_closed.hgrm and BASE_open.hgrm ('' = none)");
  app.add_option(
         "--min-accuracy", st.min_accuracy,
         "exit 1 if a client's accuracy is below this, 0..1 (0 with synthetic data unless given)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--data-dir", st.data_dir,
                 "Fashion-MNIST IDX files (Debian: dataset-fashion-mnist)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help: 0; an unknown or bad argument: 2
  }
  try {
    return run(st, app.count("--min-accuracy") > 0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", kName, e.what());
    return 1;
  }
}
