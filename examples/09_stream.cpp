// 09_stream: a Stream serving requests, the request path of an inference server.
//
// Two stages on two emulated devices: "check" (device 0) refuses negative numbers by
// throwing, "square" (device 1) squares what passes. A client pushes 100 requests (request
// 37 is -1, a bad one) and pops its own responses as they come back, in the order it pushed
// them. The bad request is answered with an error naming the stage that threw, and the stream
// goes on serving the others. Closing the stream drains it: everything already accepted is
// answered, then it ends. The program checks every request was answered exactly once, in
// push order, with its own square or (request 37 only) an error from "check".
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <bspflow/bspflow.hpp>

namespace {
constexpr std::uint64_t kRequests = 100;
constexpr std::uint64_t kBad = 37;  // the request that fails
}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h") {
      std::puts(
          "usage: 09_stream\n  no options: serves 100 requests (one bad) through a 2-stage stream, "
          "checks every answer, exits 0 if right");
      return 0;
    }
    std::fprintf(stderr, "09_stream: unknown argument '%s' (try --help)\n", argv[i]);
    return 2;
  }
  auto check = [](long x) {  // a stage's exception answers its request with an error
    if (x < 0) throw std::invalid_argument("negative input " + std::to_string(x));
    return x;
  };
  auto square = [](long x) { return x * x; };
  bspflow::DeviceGroup devices(2);
  auto stream = bspflow::StreamBuilder<long>(devices)
                    .stage("check", check)    // device 0
                    .stage("square", square)  // device 1
                    .build();                 // a Stream<long, long>
  auto client = stream.client();  // one per client thread: sequence numbers 0, 1, 2, ...
  stream.start();                 // returns at once; the devices wait for requests

  std::vector<int> answers(kRequests, 0);  // per request sequence number
  std::uint64_t next = 0, wrong = 0, errors = 0;
  auto take = [&](const bspflow::Response<long>& resp) {
    const std::uint64_t k = resp.id.sequence;
    if (k >= kRequests || k != next++) {
      ++wrong;  // unknown, or out of push order
      return;
    }
    ++answers[k];
    if (resp.ok()) {
      wrong += k == kBad || *resp.value != static_cast<long>(k * k) ? 1 : 0;
    } else {
      ++errors;
      std::printf("request %llu: error: %s\n", static_cast<unsigned long long>(k),
                  resp.error->message.c_str());
      wrong += k != kBad || resp.error->stage_name != "check" ? 1 : 0;
    }
  };
  for (std::uint64_t k = 0; k < kRequests; ++k) {
    if (!client.push(k == kBad ? -1 : static_cast<long>(k))) ++wrong;  // refused: none should be
    while (auto resp = client.try_pop()) take(*resp);                  // what has come back so far
  }
  stream.close();                                // no more requests: it drains, then ends
  while (auto resp = client.pop()) take(*resp);  // nullopt once every request is answered
  const bspflow::StreamResult r = stream.wait();

  std::uint64_t once = 0;
  for (int a : answers) once += a == 1 ? 1 : 0;
  std::printf("stream: %s\n", r.message.c_str());
  std::printf("host: %llu of %llu requests answered exactly once, %llu error(s), %llu wrong\n",
              static_cast<unsigned long long>(once), static_cast<unsigned long long>(kRequests),
              static_cast<unsigned long long>(errors), static_cast<unsigned long long>(wrong));
  if (!r.completed() || r.accepted != kRequests || r.answered != kRequests || r.errors != 1 ||
      r.unanswered != 0 || once != kRequests || errors != 1 || wrong != 0) {
    std::fprintf(stderr,
                 "FAILED: expected %llu requests each answered once, in order, one with an error\n",
                 static_cast<unsigned long long>(kRequests));
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
