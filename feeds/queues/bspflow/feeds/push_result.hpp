/// @file
/// PushResult: what a non-blocking push into an infeed or outfeed returns.
#pragma once

namespace bspflow {

/// Result of a non-blocking push (InfeedQueue::Producer::try_push).
enum class PushResult {
  kOk,      ///< the element was taken (moved from)
  kFull,    ///< the target lane is at capacity; the element was not moved from
  kClosed,  ///< the queue is closed; the element was not moved from
};

}  // namespace bspflow
