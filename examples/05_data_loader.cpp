// 05_data_loader: a DataLoader feeding a device loop, two replicas, two epochs.
//
// A SyntheticDataset of 1000 labelled samples goes through a shuffling DataLoader (batch 8,
// 10 device iterations, 2 replicas: 160 samples per host step, so 6 steps per epoch and 40
// samples dropped). Each step, feed_next() moves replica r's 10 micro-batches into lane r
// of an InfeedQueue<Batch>, and loops::repeat runs 10 iterations on each of two devices.
// The devices record which samples they saw; the host checks every epoch delivered each
// kept sample exactly once, with its own label, and the two replicas saw different ones.
#include <algorithm>
#include <cstdio>
#include <string_view>
#include <vector>

#include <bspflow/bspflow.hpp>

struct Seen {  // a replica's loop state
  std::vector<std::uint64_t> indices;
  int wrong_labels = 0;
};

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h") {
      std::puts(
          "usage: 05_data_loader\n  no options: loads two epochs, checks the samples, exits 0 if "
          "right");
      return 0;
    }
    std::fprintf(stderr, "05_data_loader: unknown argument '%s' (try --help)\n", argv[i]);
    return 2;
  }
  const bspflow::SyntheticDataset data(
      {.size = 1000, .spec = {bspflow::DType::kFloat32, {4}}, .classes = 10});
  bspflow::Options opts;
  opts.device_iterations(10).replicas(2);
  bspflow::LoaderConfig lc;
  lc.batch_size = 8;
  lc.shuffle = true;  // a different order every epoch, the same for the same seed
  lc.seed = 42;
  lc.mode = bspflow::LoaderMode::kAsync;  // 2 worker threads load steps ahead
  lc.num_workers = 2;
  bspflow::DataLoader loader(opts, data, lc);
  std::printf("%llu steps per epoch, %llu samples dropped per epoch\n",
              static_cast<unsigned long long>(loader.steps()),
              static_cast<unsigned long long>(loader.dropped()));

  bspflow::InfeedQueue<bspflow::Batch> infeed(opts.infeed_config());
  auto producer = infeed.make_producer();
  bspflow::DeviceGroup devices(2, opts.device_config());
  auto body = [&data](Seen& seen, bspflow::Batch& b) {  // one micro-batch per iteration
    for (std::size_t i = 0; i < b.valid; ++i) {
      seen.indices.push_back(b.indices[i]);
      seen.wrong_labels += b.labels[i] != data.label(b.indices[i]) ? 1 : 0;
    }
  };
  int failures = 0;
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::vector<std::uint64_t> all;
    std::size_t per_replica[2] = {0, 0};
    int steps = 0, wrong = 0;
    while (loader.feed_next(producer)) {  // false at the end of the epoch
      const auto r =
          bspflow::loops::repeat(devices, opts.device_iterations(), body, Seen{}, infeed);
      failures += r.completed() ? 0 : 1;
      for (std::uint32_t rep = 0; rep < 2; ++rep) {
        all.insert(all.end(), r.state(rep).indices.begin(), r.state(rep).indices.end());
        per_replica[rep] += r.state(rep).indices.size();
        wrong += r.state(rep).wrong_labels;
      }
      ++steps;
    }
    const std::uint64_t first = all.empty() ? 0 : all.front();  // the epoch's first sample
    std::sort(all.begin(), all.end());
    const bool distinct = std::adjacent_find(all.begin(), all.end()) == all.end();
    std::printf(
        "epoch %d: %d steps, starting with sample %llu; replica 0 saw %zu samples, replica 1 %zu; "
        "%s; %d wrong labels\n",
        epoch, steps, static_cast<unsigned long long>(first), per_replica[0], per_replica[1],
        distinct ? "no sample twice" : "DUPLICATES", wrong);
    if (static_cast<std::uint64_t>(steps) != loader.steps() ||
        all.size() != data.size() - loader.dropped() || per_replica[0] != per_replica[1] ||
        !distinct || wrong != 0) {
      ++failures;
    }
  }
  if (failures != 0) {
    std::fprintf(stderr, "FAILED: expected %llu distinct, correctly labelled samples per epoch\n",
                 static_cast<unsigned long long>(data.size() - loader.dropped()));
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
