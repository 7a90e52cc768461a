#include "bspflow/devices/arena.hpp"

#include <algorithm>
#include <sstream>

#include "bspflow/base/error.hpp"
#include "bspflow/base/tunables.hpp"
#include "bspflow/devices/device_tunables.hpp"
#include "bspflow/devices/topology.hpp"

namespace bspflow {

namespace {
constexpr std::size_t kAlign = tunables::kArenaAlignment;
std::size_t round_up(std::size_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}
}  // namespace

Arena::Arena(std::size_t bytes, int numa_node, std::string owner)
    : owner_(std::move(owner)), capacity_(bytes / kAlign * kAlign),
      base_(static_cast<std::byte*>(Topology::get().allocate(capacity_, numa_node))) {
  if (capacity_ > 0) free_.emplace(0, capacity_);
}

Arena::~Arena() {
  Topology::get().release(base_, capacity_);
}

// free_ holds, besides the free blocks, one entry of 0 bytes at the offset of each live
// allocation: release() turns that entry into the free block, so giving memory back never
// allocates (it runs in destructors and on the way out of failed runs, and must not throw).
void* Arena::allocate(std::size_t bytes, std::string_view what) {
  const std::size_t need = round_up(std::max<std::size_t>(bytes, 1));
  std::lock_guard lock(mutex_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    const std::size_t offset = it->first;
    const std::size_t rest = it->second - need;
    // What can throw (the two new entries) comes before anything changes. Each reuses a
    // node an earlier release() kept, if there is one.
    std::map<std::size_t, Allocation>::iterator a;
    if (auto node = take_node(spare_allocations_, spare_allocations_count_)) {
      node.key() = offset;
      Allocation& entry = node.mapped();
      try {
        entry.name.assign(what);  // in the room the last name left, if it fits
      } catch (...) {
        keep_node(std::move(node), spare_allocations_, spare_allocations_count_);
        throw;
      }
      entry.offset = offset;
      entry.bytes = need;
      a = allocations_.insert(std::move(node)).position;
    } else {
      a = allocations_.emplace(offset, Allocation{std::string(what), offset, need}).first;
    }
    if (rest > 0) {
      if (auto node = take_node(spare_free_, spare_free_count_)) {
        node.key() = offset + need;
        node.mapped() = rest;
        free_.insert(std::next(it), std::move(node));
      } else {
        try {
          free_.emplace_hint(std::next(it), offset + need, rest);
        } catch (...) {
          keep_node(allocations_.extract(a), spare_allocations_, spare_allocations_count_);
          throw;
        }
      }
    }
    it->second = 0;  // the allocation's entry
    used_ += need;
    return base_ + offset;
  }
  const std::size_t free_now = capacity_ - used_;
  std::ostringstream os;
  os << owner_ << ": out of memory allocating " << format_bytes(bytes) << " for '" << what
     << "': " << format_bytes(free_now) << " free of " << format_bytes(capacity_);
  if (free_now >= need) {
    os << " (but fragmented: largest free block " << format_bytes(largest_free_locked()) << ")";
  }
  os << ". " << report_locked()
     << ". Raise tiles or bytes_per_tile, or shrink what holds the memory.";
  throw OutOfMemoryError(os.str(), bytes, free_now);
}

void Arena::release(void* ptr) noexcept {
  if (ptr == nullptr) return;
  const auto* p = static_cast<std::byte*>(ptr);
  if (p < base_ || p >= base_ + capacity_) return;
  const auto offset = static_cast<std::size_t>(p - base_);
  std::lock_guard lock(mutex_);
  auto a = allocations_.find(offset);
  if (a == allocations_.end()) return;
  const std::size_t size = a->second.bytes;
  used_ -= size;
  keep_node(allocations_.extract(a), spare_allocations_, spare_allocations_count_);
  auto self = free_.find(offset);  // the allocation's entry (allocate() made it)
  self->second = size;
  // Coalesce with the free neighbours on either side (an entry of 0 bytes is an allocation).
  if (auto next = std::next(self);
      next != free_.end() && next->second > 0 && offset + size == next->first) {
    self->second += next->second;
    keep_node(free_.extract(next), spare_free_, spare_free_count_);
  }
  if (self != free_.begin()) {
    if (auto prev = std::prev(self); prev->second > 0 && prev->first + prev->second == offset) {
      prev->second += self->second;
      keep_node(free_.extract(self), spare_free_, spare_free_count_);
    }
  }
}

std::size_t Arena::used() const noexcept {
  std::lock_guard lock(mutex_);
  return used_;
}

std::size_t Arena::free_bytes() const noexcept {
  std::lock_guard lock(mutex_);
  return capacity_ - used_;
}

std::size_t Arena::largest_free_block() const noexcept {
  std::lock_guard lock(mutex_);
  return largest_free_locked();
}

std::size_t Arena::largest_free_locked() const {
  std::size_t best = 0;
  for (const auto& [offset, size] : free_) best = std::max(best, size);
  return best;
}

std::vector<Arena::Allocation> Arena::allocations() const {
  std::vector<Allocation> out;
  {
    std::lock_guard lock(mutex_);
    for (const auto& [offset, a] : allocations_) out.push_back(a);
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const Allocation& a, const Allocation& b) { return a.bytes > b.bytes; });
  return out;
}

std::string Arena::report() const {
  std::lock_guard lock(mutex_);
  return report_locked();
}

std::string Arena::report_locked() const {
  // Group by name, largest first: ten 1 MiB 'activations' read better as one 10 MiB line.
  std::map<std::string, std::pair<std::size_t, std::size_t>> by_name;  // bytes, count
  for (const auto& [offset, a] : allocations_) {
    auto& entry = by_name[a.name];
    entry.first += a.bytes;
    entry.second += 1;
  }
  std::vector<std::pair<std::string, std::pair<std::size_t, std::size_t>>> rows(by_name.begin(),
                                                                                by_name.end());
  std::stable_sort(rows.begin(), rows.end(),
                   [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
  std::ostringstream os;
  os << format_bytes(used_) << " used of " << format_bytes(capacity_);
  if (rows.empty()) return os.str() + ", nothing allocated";
  os << ", held by:";
  constexpr std::size_t kShown = 8;
  for (std::size_t i = 0; i < rows.size() && i < kShown; ++i) {
    os << (i == 0 ? " '" : ", '") << rows[i].first << "' " << format_bytes(rows[i].second.first);
    if (rows[i].second.second > 1) os << " (" << rows[i].second.second << " allocations)";
  }
  if (rows.size() > kShown) os << ", and " << rows.size() - kShown << " more names";
  return os.str();
}

}  // namespace bspflow
