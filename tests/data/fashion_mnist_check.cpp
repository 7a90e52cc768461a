// The real Fashion-MNIST files from Debian's dataset-fashion-mnist load with the expected
// shapes. Exits 77 (meson: skipped) when the package is not installed.
//   fashion_mnist_check [DIR]
#include <cstdio>
#include <filesystem>
#include <set>
#include <vector>

#include <bspflow/data/data_loader.hpp>
#include <bspflow/data/dataset.hpp>
#include <bspflow/data/idx.hpp>

int main(int argc, char** argv) {
  const std::filesystem::path dir = argc > 1 ? argv[1] : bspflow::idx::kDebianFashionMnistDir;
  if (!std::filesystem::exists(dir / "train-images-idx3-ubyte.gz")) {
    std::printf("skipped: %s has no Fashion-MNIST (apt-get install dataset-fashion-mnist)\n",
                dir.c_str());
    return 77;
  }
  int failures = 0;
  const auto check = [&](bool ok, const char* what) {
    std::printf("%s: %s\n", ok ? "ok" : "FAILED", what);
    if (!ok) ++failures;
  };
  for (const auto& [split, n] : {std::pair{"train", 60000u}, std::pair{"t10k", 10000u}}) {
    const auto d = bspflow::idx::load_mnist(dir, split);
    std::printf("%s: %zu images of %u x %u, %zu labels\n", split, d.images.items(),
                d.images.dims[1], d.images.dims[2], d.labels.items());
    check(d.images.items() == n && d.labels.items() == n, "sample count");
    check(d.images.dims[1] == 28 && d.images.dims[2] == 28, "28 x 28 images");
    std::set<int> classes;
    for (std::byte b : d.labels.data) classes.insert(static_cast<int>(b));
    check(classes.size() == 10 && *classes.begin() == 0 && *classes.rbegin() == 9,
          "labels are the 10 classes 0..9");
  }
  // Through the DataLoader with the pipelining tutorial's shape (batch 40, 10 device
  // iterations, 10 gradient accumulation: 4000 samples per step), shuffled, 2 workers.
  const bspflow::TensorDataset train = bspflow::mnist_dataset(dir, "train");
  check(train.size() == 60000 && train.spec().describe() == "uint8[1x28x28]",
        "mnist_dataset: 60000 uint8[1x28x28] samples");
  bspflow::LoaderConfig lc;
  lc.batch_size = 40;
  lc.shuffle = true;
  lc.mode = bspflow::LoaderMode::kAsync;
  lc.num_workers = 2;
  bspflow::DataLoader loader(bspflow::StepShape{10, 10, 1}, train, lc);
  std::vector<int> seen(train.size(), 0);
  bool labels_match = true;
  for (auto& step : loader) {
    for (const bspflow::Batch& b : step.batches()) {
      for (std::size_t k = 0; k < b.valid; ++k) {
        ++seen[b.indices[k]];
        labels_match = labels_match && b.labels[k] == train.labels()[b.indices[k]];
      }
    }
  }
  std::size_t once = 0;
  for (int c : seen) once += c == 1 ? 1 : 0;
  std::printf("loader: %llu steps of 4000, %zu of 60000 images delivered exactly once\n",
              static_cast<unsigned long long>(loader.steps()), once);
  check(loader.steps() == 15 && loader.dropped() == 0 && once == 60000,
        "every training image delivered exactly once per epoch");
  check(labels_match, "labels travel with their images");
  return failures == 0 ? 0 : 1;
}
