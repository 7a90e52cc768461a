// t06_text_generation: a small autoregressive model with attention, trained here on the
// words of the `wamerican` word list, served by a generate stage that batches per iteration
// and keeps each sequence's keys and values (its KV cache) in paged blocks of the device's
// arena; then the same model behind a request-level batch stage, for comparison.
//
//   t06_text_generation [--words FILE] [--train-words N] [--epochs E] [--clients C]
//       [--requests N] [--in-flight F] [--max-active A] [--block-tokens B] [--seed S]
//       [--samples K] [--min-accuracy X]
//
// 1. The data. Words of 2..14 lower-case letters from --words (/usr/share/dict/words, from
//    Debian's wamerican package), shuffled with --seed; --train-words of them train the model
//    and a thousand others are held out. A word is read as '.', its letters, '.': the model
//    learns to predict each next character.
// 2. The model. Characters embed into 32 dimensions (plus a learnt position), one causal
//    self-attention head (queries, keys, values, an output projection and a residual), a
//    64-unit ReLU layer with a residual, and the 27 logits. It trains with Adam, one word at
//    a time, for --epochs passes; backpropagation is written out below. The example prints
//    the held-out next-character accuracy (about 0.3 after one pass over 20,000 words; a
//    uniform guess scores 0.04) and fails below --min-accuracy.
// 3. Serving. A Stream with one generate stage on one device: a request is a seed and a
//    sampling temperature; each iteration feeds every active sequence its last character,
//    appends that character's key and value to its paged state (one entry per token, in
//    blocks of --block-tokens), attends over its whole cache and samples the next character
//    (with the sequence's own random state, so a word does not depend on its batch). A
//    sequence ends when it samples '.', or after 14 characters. --clients threads each push
//    --requests requests, keeping --in-flight of them in flight, and read each word's
//    characters as they stream in (Ordering::kNone: a client's words stream side by side).
// 4. The comparison. The same model as a batch stage (up to --max-active requests per
//    batch): it runs the whole batch until its longest word is done, computing the finished
//    ones too (static batching pads), and answers each request once, with its word.
// 5. For each: time to first token p50/p99, inter-token p50/p99 (the client sees every
//    character of a batched word at once: 0), tokens/s, and a few generated words. The exit
//    status is 1 if a request was lost, a word from the two services differs for the same
//    seed, or the accuracy is below --min-accuracy.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <bspflow/bspflow.hpp>

namespace {

constexpr int kVocab = 27;      // '.' (a word's boundary), then 'a'..'z'
constexpr int kDim = 32;        // embedding, query, key and value width
constexpr int kHidden = 64;     // the ReLU layer
constexpr int kMaxTokens = 16;  // positions: '.' and up to 15 characters

int token_of(char c) {
  return c == '.' ? 0 : c - 'a' + 1;
}
char char_of(int t) {
  return t == 0 ? '.' : static_cast<char>('a' + t - 1);
}

// A weight matrix (rows x cols, row-major) with its gradient and Adam's moments.
struct Param {
  int rows = 0, cols = 0;
  std::vector<float> w, g, m, v;
  Param(int r, int c, std::mt19937& rng, float scale) : rows(r), cols(c) {
    const auto n = static_cast<std::size_t>(r) * static_cast<std::size_t>(c);
    std::normal_distribution<float> init(0.0f, scale);
    w.resize(n);
    for (float& x : w) x = init(rng);
    g.assign(n, 0.0f);
    m.assign(n, 0.0f);
    v.assign(n, 0.0f);
  }
  float* row(int r) { return w.data() + static_cast<std::size_t>(r) * cols; }
  const float* row(int r) const { return w.data() + static_cast<std::size_t>(r) * cols; }
  float* grad_row(int r) { return g.data() + static_cast<std::size_t>(r) * cols; }
};

// y = W x (W: rows x cols).
void matvec(const Param& p, const float* x, float* y) {
  for (int r = 0; r < p.rows; ++r) {
    const float* wr = p.row(r);
    float s = 0.0f;
    for (int c = 0; c < p.cols; ++c) s += wr[c] * x[c];
    y[r] = s;
  }
}
// Backward of y = W x: dW += dy x^T, dx += W^T dy.
void matvec_back(Param& p, const float* x, const float* dy, float* dx) {
  for (int r = 0; r < p.rows; ++r) {
    float* gr = p.grad_row(r);
    const float* wr = p.row(r);
    for (int c = 0; c < p.cols; ++c) {
      gr[c] += dy[r] * x[c];
      dx[c] += wr[c] * dy[r];
    }
  }
}

using Vec = std::array<float, kDim>;

// One token's key and value: the paged state's entry (the KV cache).
struct KV {
  Vec k, v;
};

class Model {
 public:
  explicit Model(std::uint32_t seed)
      : rng_(seed), embed_(kVocab, kDim, rng_, 0.3f), pos_(kMaxTokens, kDim, rng_, 0.1f),
        wq_(kDim, kDim, rng_, 0.18f), wk_(kDim, kDim, rng_, 0.18f), wv_(kDim, kDim, rng_, 0.18f),
        wo_(kDim, kDim, rng_, 0.18f), w1_(kHidden, kDim, rng_, 0.18f),
        w2_(kDim, kHidden, rng_, 0.12f), out_(kVocab, kDim, rng_, 0.18f) {}

  // One position of the forward pass: token `tok` at position `t`, attending over `cache`
  // (positions 0..t-1) and its own key and value, which it returns in `mine`. Writes the
  // logits; keeps what the backward pass needs in `f`.
  struct Fwd {
    Vec x{}, q{}, a{}, h{}, o{}, h2{};
    std::array<float, kHidden> z{};
    std::array<float, kMaxTokens> alpha{};
    std::array<float, kVocab> logits{};
  };
  template <class Cache>
  void step(int tok, int t, const Cache& cache, KV& mine, Fwd& f) const {
    for (int i = 0; i < kDim; ++i) f.x[i] = embed_.row(tok)[i] + pos_.row(t)[i];
    matvec(wq_, f.x.data(), f.q.data());
    matvec(wk_, f.x.data(), mine.k.data());
    matvec(wv_, f.x.data(), mine.v.data());
    const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
    float top = -1e30f;
    for (int j = 0; j <= t; ++j) {
      const KV& kv = j < t ? cache[static_cast<std::size_t>(j)] : mine;
      float s = 0.0f;
      for (int i = 0; i < kDim; ++i) s += f.q[i] * kv.k[i];
      f.alpha[j] = s * scale;
      top = std::max(top, f.alpha[j]);
    }
    float sum = 0.0f;
    for (int j = 0; j <= t; ++j) sum += (f.alpha[j] = std::exp(f.alpha[j] - top));
    f.a.fill(0.0f);
    for (int j = 0; j <= t; ++j) {
      f.alpha[j] /= sum;
      const KV& kv = j < t ? cache[static_cast<std::size_t>(j)] : mine;
      for (int i = 0; i < kDim; ++i) f.a[i] += f.alpha[j] * kv.v[i];
    }
    matvec(wo_, f.a.data(), f.o.data());
    for (int i = 0; i < kDim; ++i) f.h[i] = f.x[i] + f.o[i];
    matvec(w1_, f.h.data(), f.z.data());
    for (float& z : f.z) z = std::max(0.0f, z);
    matvec(w2_, f.z.data(), f.h2.data());
    for (int i = 0; i < kDim; ++i) f.h2[i] += f.h[i];
    matvec(out_, f.h2.data(), f.logits.data());
  }

  // One word: forward over every position, then backward, gradients added. Returns how many
  // next characters the model ranked first.
  int train_word(const std::string& word, float lr) {
    std::vector<int> toks{0};
    for (char c : word) toks.push_back(token_of(c));
    const int n = static_cast<int>(toks.size());  // inputs; targets are toks[1..] and '.'
    std::vector<KV> kv(static_cast<std::size_t>(n));
    std::vector<Fwd> f(static_cast<std::size_t>(n));
    std::vector<std::array<float, kVocab>> dlogits(static_cast<std::size_t>(n));
    int right = 0;
    for (int t = 0; t < n; ++t) {
      const auto ut = static_cast<std::size_t>(t);
      step(toks[ut], t, kv, kv[ut], f[ut]);
      const int target = t + 1 < n ? toks[ut + 1] : 0;
      const auto& lg = f[ut].logits;
      const float top = *std::max_element(lg.begin(), lg.end());
      float sum = 0.0f;
      for (int c = 0; c < kVocab; ++c) sum += (dlogits[ut][c] = std::exp(lg[c] - top));
      for (float& d : dlogits[ut]) d /= sum;
      if (std::max_element(lg.begin(), lg.end()) - lg.begin() == target) ++right;
      dlogits[ut][target] -= 1.0f;
      for (float& d : dlogits[ut]) d /= static_cast<float>(n);
    }
    // Backward, last position first: a key's and a value's gradients gather from every later
    // position that attended to them.
    std::vector<Vec> dk(static_cast<std::size_t>(n)), dv(static_cast<std::size_t>(n));
    for (auto& d : dk) d.fill(0.0f);
    for (auto& d : dv) d.fill(0.0f);
    const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
    for (int t = n - 1; t >= 0; --t) {
      const auto ut = static_cast<std::size_t>(t);
      Fwd& fw = f[ut];
      Vec dh2{}, dh{}, da{}, dq{}, dx{};
      std::array<float, kHidden> dz{};
      matvec_back(out_, fw.h2.data(), dlogits[ut].data(), dh2.data());
      dh = dh2;  // the residual
      matvec_back(w2_, fw.z.data(), dh2.data(), dz.data());
      for (int i = 0; i < kHidden; ++i) dz[i] = fw.z[i] > 0.0f ? dz[i] : 0.0f;
      matvec_back(w1_, fw.h.data(), dz.data(), dh.data());
      dx = dh;  // the residual
      matvec_back(wo_, fw.a.data(), dh.data(), da.data());
      std::array<float, kMaxTokens> dalpha{};
      float dot = 0.0f;
      for (int j = 0; j <= t; ++j) {
        const auto uj = static_cast<std::size_t>(j);
        float s = 0.0f;
        for (int i = 0; i < kDim; ++i) {
          s += da[i] * kv[uj].v[i];
          dv[uj][i] += fw.alpha[j] * da[i];
        }
        dalpha[j] = s;
        dot += fw.alpha[j] * s;
      }
      for (int j = 0; j <= t; ++j) {
        const auto uj = static_cast<std::size_t>(j);
        const float ds = fw.alpha[j] * (dalpha[j] - dot) * scale;
        for (int i = 0; i < kDim; ++i) {
          dq[i] += ds * kv[uj].k[i];
          dk[uj][i] += ds * fw.q[i];
        }
      }
      matvec_back(wq_, fw.x.data(), dq.data(), dx.data());
      // This position's key and value are complete now: no earlier position attends to it.
      matvec_back(wk_, fw.x.data(), dk[ut].data(), dx.data());
      matvec_back(wv_, fw.x.data(), dv[ut].data(), dx.data());
      for (int i = 0; i < kDim; ++i) {
        embed_.grad_row(toks[ut])[i] += dx[i];
        pos_.grad_row(t)[i] += dx[i];
      }
    }
    ++updates_;
    for (Param* p : params()) adam(*p, lr);
    return right;
  }

  // Held-out next-character accuracy.
  double accuracy(const std::vector<std::string>& words) const {
    std::size_t right = 0, total = 0;
    for (const std::string& w : words) {
      std::vector<KV> cache;
      int tok = 0;
      for (std::size_t t = 0; t <= w.size(); ++t) {
        KV mine;
        Fwd f;
        step(tok, static_cast<int>(t), cache, mine, f);
        cache.push_back(mine);
        const int target = t < w.size() ? token_of(w[t]) : 0;
        const int best =
            static_cast<int>(std::max_element(f.logits.begin(), f.logits.end()) - f.logits.begin());
        right += best == target ? 1 : 0;
        ++total;
        if (t < w.size()) tok = target;
      }
    }
    return static_cast<double>(right) / static_cast<double>(total);
  }

 private:
  std::vector<Param*> params() {
    return {&embed_, &pos_, &wq_, &wk_, &wv_, &wo_, &w1_, &w2_, &out_};
  }
  void adam(Param& p, float lr) {
    constexpr float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
    const float c1 = 1.0f - std::pow(b1, static_cast<float>(updates_));
    const float c2 = 1.0f - std::pow(b2, static_cast<float>(updates_));
    for (std::size_t i = 0; i < p.w.size(); ++i) {
      p.m[i] = b1 * p.m[i] + (1 - b1) * p.g[i];
      p.v[i] = b2 * p.v[i] + (1 - b2) * p.g[i] * p.g[i];
      p.w[i] -= lr * (p.m[i] / c1) / (std::sqrt(p.v[i] / c2) + eps);
      p.g[i] = 0.0f;
    }
  }

  std::mt19937 rng_;
  Param embed_, pos_, wq_, wk_, wv_, wo_, w1_, w2_, out_;
  std::uint64_t updates_ = 0;
};

// A request: its seed (its own random state while it generates) and temperature.
struct Request {
  std::uint64_t rng = 1;
  float temperature = 0.8f;
  int last = 0;  // the character it sampled last ('.' before the first)
};

// Samples a character from the logits, advancing the sequence's own random state.
int sample(const std::array<float, kVocab>& logits, Request& r) {
  r.rng ^= r.rng << 13;
  r.rng ^= r.rng >> 7;
  r.rng ^= r.rng << 17;
  const float u = static_cast<float>(r.rng >> 40) / static_cast<float>(1ull << 24);
  const float top = *std::max_element(logits.begin(), logits.end());
  std::array<float, kVocab> p{};
  float sum = 0.0f;
  for (int c = 0; c < kVocab; ++c) sum += (p[c] = std::exp((logits[c] - top) / r.temperature));
  float acc = 0.0f;
  for (int c = 0; c < kVocab; ++c) {
    acc += p[c] / sum;
    if (u < acc) return c;
  }
  return kVocab - 1;
}

// One sequence's next character from its last one (its cache holds the earlier positions'
// keys and values; this position's are appended).
template <class Cache, class Push>
int next_char(const Model& m, int last, int t, const Cache& cache, Push&& push, Request& r) {
  KV mine;
  Model::Fwd f;
  m.step(last, t, cache, mine, f);
  push(mine);
  return sample(f.logits, r);
}

using SteadyClock = std::chrono::steady_clock;

struct Figures {
  std::vector<double> ttft_us, itl_us;
  std::uint64_t tokens = 0;
  double seconds = 0;
  std::map<std::uint64_t, std::string> words;  // by seed
  std::uint64_t lost = 0;
};

double pct(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1,
                    static_cast<std::size_t>(q * static_cast<double>(v.size() - 1) + 0.5))];
}

// Runs `clients` threads, each pushing `requests` requests (seeds base + k*requests + i),
// `in_flight` at a time, and reading every response: a character (streamed) or a word.
template <class S>
Figures serve(S& stream, int clients, int requests, int in_flight, std::uint64_t base) {
  std::vector<decltype(stream.client())> cs;
  for (int k = 0; k < clients; ++k) cs.push_back(stream.client());
  stream.start();
  Figures all;
  std::mutex m;
  const auto t0 = SteadyClock::now();
  std::vector<std::thread> threads;
  for (int k = 0; k < clients; ++k) {
    threads.emplace_back([&, k] {
      auto& c = cs[static_cast<std::size_t>(k)];
      Figures mine;
      std::map<std::uint64_t, std::uint64_t> seed_of;         // sequence -> seed
      std::map<std::uint64_t, SteadyClock::time_point> last;  // its push, then its last response
      const auto take = [&](const auto& r) {
        const auto now = SteadyClock::now();
        const std::uint64_t s = r.id.sequence;
        const double us = std::chrono::duration<double, std::micro>(now - last[s]).count();
        (r.index == 0 ? mine.ttft_us : mine.itl_us).push_back(us);
        last[s] = now;
        if (!r.ok()) {
          std::printf("request %llu failed: %s\n", static_cast<unsigned long long>(s),
                      r.error->message.c_str());
          ++mine.lost;
          return;
        }
        std::string& w = mine.words[seed_of[s]];
        if constexpr (std::is_same_v<std::decay_t<decltype(*r.value)>, char>) {
          mine.tokens += 1;
          if (*r.value != '.') w += *r.value;
        } else {
          mine.tokens += r.value->size() + 1;  // its characters and the final '.'
          w = *r.value;
          for (std::size_t i = 0; i + 1 < r.value->size() + 1; ++i) mine.itl_us.push_back(0.0);
        }
      };
      for (int i = 0; i < requests; ++i) {
        // Keep `in_flight` words in flight: pop (blocking) while that many are outstanding.
        while (c.outstanding() >= static_cast<std::uint64_t>(in_flight)) {
          if (auto r = c.pop()) take(*r);
        }
        const std::uint64_t seed = base + static_cast<std::uint64_t>(k * requests + i);
        const auto now = SteadyClock::now();
        const bspflow::Submission s = c.push(Request{seed * 0x9E3779B97F4A7C15ull | 1, 0.8f, 0});
        if (!s) {
          ++mine.lost;
          continue;
        }
        seed_of[s.id.sequence] = seed;
        last[s.id.sequence] = now;
      }
      while (auto r = c.pop()) take(*r);
      std::lock_guard lock(m);
      all.ttft_us.insert(all.ttft_us.end(), mine.ttft_us.begin(), mine.ttft_us.end());
      all.itl_us.insert(all.itl_us.end(), mine.itl_us.begin(), mine.itl_us.end());
      all.tokens += mine.tokens;
      all.lost += mine.lost;
      all.words.insert(mine.words.begin(), mine.words.end());
    });
  }
  for (auto& t : threads) t.join();
  all.seconds = std::chrono::duration<double>(SteadyClock::now() - t0).count();
  stream.close();
  const bspflow::StreamResult result = stream.wait();
  if (!result.drained()) ++all.lost;
  return all;
}

void print(const char* what, const Figures& f) {
  std::printf(
      "%-22s ttft p50 %7.1f us  p99 %8.1f us   inter-token p50 %6.1f us  p99 %7.1f us   "
      "%8.0f tokens/s\n",
      what, pct(f.ttft_us, 0.5), pct(f.ttft_us, 0.99), pct(f.itl_us, 0.5), pct(f.itl_us, 0.99),
      static_cast<double>(f.tokens) / f.seconds);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "t06_text_generation: a small attention model trained on words, served one "
      "character per iteration with its KV cache in paged blocks"};
  std::string words_path = "/usr/share/dict/words";
  int train_words = 20000, epochs = 1, clients = 4, requests = 200, in_flight = 4, samples = 8;
  std::uint32_t max_active = 16, block_tokens = 4, seed = 1;
  double min_accuracy = 0.2;
  app.add_option("--words", words_path, "the word list (Debian's wamerican)")
      ->capture_default_str();
  app.add_option("--train-words", train_words, "words to train on")
      ->check(CLI::Range(100, 1000000))
      ->capture_default_str();
  app.add_option("--epochs", epochs, "passes over them")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  app.add_option("--clients", clients, "client threads")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--requests", requests, "requests per client")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  app.add_option("--in-flight", in_flight, "words each client keeps in flight")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--max-active", max_active, "sequences per iteration (and per batch)")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--block-tokens", block_tokens, "tokens per block of the KV cache")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--seed", seed, "shuffles the words, initialises the model")
      ->capture_default_str();
  app.add_option("--samples", samples, "generated words to print")
      ->check(CLI::Range(0, 1000))
      ->capture_default_str();
  app.add_option("--min-accuracy", min_accuracy, "fail below this held-out accuracy")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  // 1. The data.
  std::ifstream in(words_path);
  if (!in) {
    std::fprintf(stderr,
                 "t06_text_generation: cannot read the word list '%s' (install Debian's "
                 "wamerican package, or give --words FILE)\n",
                 words_path.c_str());
    return 1;
  }
  std::vector<std::string> words;
  for (std::string w; std::getline(in, w);) {
    if (w.size() < 2 || w.size() > kMaxTokens - 2) continue;
    if (!std::all_of(w.begin(), w.end(), [](char c) { return c >= 'a' && c <= 'z'; })) continue;
    words.push_back(w);
  }
  std::mt19937 shuffle(seed);
  std::shuffle(words.begin(), words.end(), shuffle);
  const std::size_t held = std::min<std::size_t>(1000, words.size() / 10);
  const std::vector<std::string> test(words.begin(),
                                      words.begin() + static_cast<std::ptrdiff_t>(held));
  words.erase(words.begin(), words.begin() + static_cast<std::ptrdiff_t>(held));
  if (words.size() > static_cast<std::size_t>(train_words))
    words.resize(static_cast<std::size_t>(train_words));
  std::printf("%zu words to train on, %zu held out (from %s)\n", words.size(), test.size(),
              words_path.c_str());

  // 2. Training.
  Model model(seed);
  const auto t_train = SteadyClock::now();
  for (int e = 0; e < epochs; ++e) {
    std::size_t right = 0, total = 0;
    for (const std::string& w : words) {
      right += static_cast<std::size_t>(model.train_word(w, 0.003f));
      total += w.size() + 1;
    }
    std::printf("epoch %d: training accuracy %.3f\n", e + 1,
                static_cast<double>(right) / static_cast<double>(total));
  }
  const double acc = model.accuracy(test);
  std::printf("held-out next-character accuracy %.3f (uniform guess %.3f), trained in %.1f s\n",
              acc, 1.0 / kVocab,
              std::chrono::duration<double>(SteadyClock::now() - t_train).count());

  // 3. Served by a generate stage: one character per sequence per iteration, its key and
  // value appended to its paged state (the KV cache).
  bspflow::StreamConfig sc;
  sc.ordering = bspflow::Ordering::kNone;
  bspflow::GenerateConfig gen;
  gen.max_active = max_active;
  gen.max_length = kMaxTokens - 1;  // positions 0..14: '.' and 14 characters
  gen.block_entries = block_tokens;
  auto step = [&model](std::span<bspflow::Generation<Request, KV>> active) {
    std::vector<bspflow::StepOutput<char>> out;
    out.reserve(active.size());
    for (auto& g : active) {
      auto& state = g.state();
      Request& r = g.input();
      const int next = next_char(
          model, r.last, static_cast<int>(g.step()), state,
          [&state](const KV& kv) { state.push_back(kv); }, r);
      r.last = next;
      out.push_back(next == 0 ? bspflow::StepOutput<char>::last('.')
                              : bspflow::StepOutput<char>::next(char_of(next)));
    }
    return out;
  };
  bspflow::DeviceGroup devices(1);
  auto streamed =
      bspflow::StreamBuilder<Request>(devices, sc).generate_stage<KV>("decode", step, gen).build();
  const Figures it = serve(streamed, clients, requests, in_flight, 1);
  const bspflow::StreamStats st = streamed.stats();
  const bspflow::GenerateStats& gs = *st.stages.at(0).generation;

  // 4. The same model behind a request-level batch stage: each batch runs until its longest
  // word is done, computing the finished ones too.
  bspflow::BatchConfig bc;
  bc.max_batch = max_active;
  auto batch = [&model](std::span<Request> rs) {
    const std::size_t n = rs.size();
    std::vector<std::vector<KV>> caches(n);
    std::vector<std::string> words(n);
    std::vector<bool> done(n, false);
    for (int t = 0; t < kMaxTokens - 1; ++t) {
      bool any = false;
      for (std::size_t i = 0; i < n; ++i) {
        auto push = [&caches, i](const KV& kv) { caches[i].push_back(kv); };
        if (done[i]) {  // padding: computed, not used
          Request spare = rs[i];
          (void)next_char(model, 0, t, caches[i], push, spare);
          continue;
        }
        const int next = next_char(model, rs[i].last, t, caches[i], push, rs[i]);
        rs[i].last = next;
        if (next == 0) {
          done[i] = true;
        } else {
          words[i] += char_of(next);
        }
        any = any || !done[i];
      }
      if (!any) break;
    }
    return words;
  };
  bspflow::DeviceGroup batch_devices(1);
  auto batched =
      bspflow::StreamBuilder<Request>(batch_devices, sc).batch_stage("decode", batch, bc).build();
  const Figures rq = serve(batched, clients, requests, in_flight, 1);

  // 5. The figures, and a few words.
  std::printf(
      "\n%d clients x %d requests, %d in flight each, max_active %u, blocks of %u "
      "tokens:\n",
      clients, requests, in_flight, max_active, block_tokens);
  print("iteration-level", it);
  print("request-level batches", rq);
  std::printf(
      "generate stage: %llu iterations, %llu tokens, %llu preemptions, pool of %llu "
      "blocks (%llu in use at the end)\n",
      static_cast<unsigned long long>(gs.iterations), static_cast<unsigned long long>(gs.tokens),
      static_cast<unsigned long long>(gs.preemptions), static_cast<unsigned long long>(gs.blocks),
      static_cast<unsigned long long>(gs.blocks_used));
  int shown = 0;
  std::size_t differ = 0;
  for (const auto& [s, w] : it.words) {
    const auto other = rq.words.find(s);
    if (other == rq.words.end() || other->second != w) ++differ;
    if (shown++ < samples)
      std::printf("  seed %llu: %s\n", static_cast<unsigned long long>(s), w.c_str());
  }
  bool ok = true;
  if (it.lost != 0 || rq.lost != 0) {
    std::printf("FAILED: %llu request(s) lost or failed\n",
                static_cast<unsigned long long>(it.lost + rq.lost));
    ok = false;
  }
  if (differ != 0 || it.words.size() != rq.words.size()) {
    std::printf("FAILED: %zu word(s) differ between the two services for the same seed\n", differ);
    ok = false;
  }
  if (acc < min_accuracy) {
    std::printf("FAILED: held-out accuracy %.3f below --min-accuracy %.3f\n", acc, min_accuracy);
    ok = false;
  }
  return ok ? 0 : 1;
}
