// Program nodes (see bspflow/engine/program.hpp): what each constructor checks.
#include "bspflow/engine/program.hpp"

#include <string>

#include "bspflow/base/error.hpp"
#include "bspflow/base/tunables.hpp"

namespace bspflow {

namespace program {
Sequence::Sequence(std::initializer_list<Program> s) : steps(s) {}
Sequence::Sequence(std::vector<Program> s) : steps(std::move(s)) {}
Execute::Execute(std::string n, std::size_t items, Vertex v)
    : name(std::move(n)), work_items(items), vertex(std::move(v)) {
  if (!vertex) throw Error("Execute '" + name + "': the vertex is empty");
}
Execute::Execute(std::string n, std::function<void(const ComputeContext&)> c)
    : name(std::move(n)), codelet(std::move(c)) {
  if (!codelet) throw Error("Execute '" + name + "': the codelet is empty");
}
Sync::Sync(std::shared_ptr<SyncGroup> g) : group(std::move(g)) {
  if (!group) throw Error("Sync: the sync group is null");
}
Copy::Copy(Buffer s, Buffer d) : src(std::move(s)), dst(std::move(d)) {
  if (!src || !dst) throw Error("Copy: a buffer is null");
  if (src->dtype() != dst->dtype() || src->elements() != dst->elements()) {
    throw Error("Copy from '" + src->name() + "' (" + std::to_string(src->elements()) + " " +
                to_string(src->dtype()) + ") to '" + dst->name() + "' (" +
                std::to_string(dst->elements()) + " " + to_string(dst->dtype()) +
                "): buffers must have the same element type and count");
  }
}
StreamCopy::StreamCopy(InfeedQueue<Tensor>& from, Buffer dst)
    : infeed(&from), buffer(std::move(dst)) {
  if (!buffer) throw Error("StreamCopy: the destination buffer is null");
}
StreamCopy::StreamCopy(Buffer src, OutfeedQueue<Tensor>& to)
    : outfeed(&to), buffer(std::move(src)) {
  if (!buffer) throw Error("StreamCopy: the source buffer is null");
}
Repeat::Repeat(std::uint64_t n, Program b) : count(n), body{std::move(b)} {}
RepeatWhile::RepeatWhile(std::function<bool(const ComputeContext&)> c, Program b, std::uint64_t max)
    : condition(std::move(c)), body{std::move(b)}, max_trips(max) {
  if (!condition) throw Error("RepeatWhile: the condition is empty");
}
RemoteCopy::RemoteCopy(std::string n, bool h, std::function<std::size_t(const ComputeContext&)> c)
    : name(std::move(n)), to_host(h), copy(std::move(c)) {
  if (!copy) throw Error("RemoteCopy '" + name + "': the copy function is empty");
}
AllReduce::AllReduce(std::string n, std::uint32_t r,
                     std::function<std::size_t(const ComputeContext&)> b)
    : name(std::move(n)), replicas(r), bytes(std::move(b)) {
  if (replicas == 0 || replicas > tunables::kMaxReplicas) {
    detail::throw_bad_value("AllReduce '" + name + "' replicas", replicas,
                            "must be in 1.." + std::to_string(tunables::kMaxReplicas));
  }
  if (!bytes) throw Error("AllReduce '" + name + "': the bytes function is empty");
}
FusedRepeat::FusedRepeat(std::string n, std::uint64_t c, Loop l, std::function<void(bool)> f)
    : name(std::move(n)), count(c), loop(std::move(l)), finish(std::move(f)) {
  if (!loop) throw Error("FusedRepeat '" + name + "': the loop is empty");
  if (!finish) throw Error("FusedRepeat '" + name + "': the finish step is empty");
}
}  // namespace program

Program::Program(program::Sequence n) : node_(std::make_shared<const Node>(std::move(n))) {}
Program::Program(program::Execute n) : node_(std::make_shared<const Node>(std::move(n))) {}
Program::Program(program::Sync n) : node_(std::make_shared<const Node>(std::move(n))) {}
Program::Program(program::Copy n) : node_(std::make_shared<const Node>(std::move(n))) {}
Program::Program(program::StreamCopy n) : node_(std::make_shared<const Node>(std::move(n))) {}
Program::Program(program::Repeat n) : node_(std::make_shared<const Node>(std::move(n))) {}
Program::Program(program::RepeatWhile n) : node_(std::make_shared<const Node>(std::move(n))) {}
Program::Program(program::FusedRepeat n) : node_(std::make_shared<const Node>(std::move(n))) {}
Program::Program(program::RemoteCopy n) : node_(std::make_shared<const Node>(std::move(n))) {}
Program::Program(program::AllReduce n) : node_(std::make_shared<const Node>(std::move(n))) {}

}  // namespace bspflow
