// The real Fashion-MNIST files from Debian's dataset-fashion-mnist load with the expected
// shapes. Exits 77 (meson: skipped) when the package is not installed.
//   fashion_mnist_check [DIR]
#include <cstdio>
#include <filesystem>
#include <set>

#include <bspflow/idx.hpp>

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
  return failures == 0 ? 0 : 1;
}
