// The calling thread's WaitNote (see bspflow/base/detail/wait_note.hpp): one thread-local,
// defined once in the library so every template instantiation shares it.
#include "bspflow/base/detail/wait_note.hpp"

namespace bspflow::detail {

namespace {
thread_local WaitNote* this_thread_note = nullptr;
}  // namespace

WaitNote* this_thread_wait_note() noexcept {
  return this_thread_note;
}

WaitNote* set_this_thread_wait_note(WaitNote* note) noexcept {
  WaitNote* before = this_thread_note;
  this_thread_note = note;
  return before;
}

}  // namespace bspflow::detail
