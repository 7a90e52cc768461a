/// @file
/// Spin: how a waiting thread polls before it parks (detail::WaitPoint::wait, the waits of
/// the queues and of SyncGroup::arrive_and_wait). WaitPolicy::spin_mode() picks one for a
/// policy; most callers never name it.
#pragma once

namespace bspflow {

/// How a spin polls. kTight re-checks after every pause: for waits whose end is latency
/// (data arriving). kBackoff doubles the pauses between checks up to 64: for waits whose
/// end is someone else's progress (room in a full queue), so that polling a counter does not
/// keep stealing its cache line from the thread that must advance it.
/// kYield gives the core away between checks: for waits whose partner may be sharing this
/// core (more devices than cores), where a tight spin would only delay the partner.
enum class Spin { kTight, kBackoff, kYield };

}  // namespace bspflow
