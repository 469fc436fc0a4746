// At most N calls of one kind at once per client (a site, a peer): what a service holds open for one
// client is bounded, so that the server's thread cap (ServerThreadsFor) never makes a well-behaved
// client's call wait. Thread-safe.
#ifndef MERIDIAN_RPC_CALL_SLOTS_H_
#define MERIDIAN_RPC_CALL_SLOTS_H_

#include <map>
#include <mutex>
#include <string>

namespace meridian::rpc {

class CallSlots {
 public:
  explicit CallSlots(int per_client) : per_client_(per_client) {}
  int per_client() const { return per_client_; }
  // How many of `client`'s slots are held now.
  int open(const std::string& client) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = open_.find(client);
    return it == open_.end() ? 0 : it->second;
  }

  // One of `client`'s slots, held until the Slot is destroyed; held() is false when all were taken.
  class Slot {
   public:
    Slot(CallSlots* slots, std::string client) : slots_(slots), client_(std::move(client)) {
      std::lock_guard<std::mutex> l(slots_->mu_);
      int& open = slots_->open_[client_];
      if (open >= slots_->per_client_) return;
      ++open;
      held_ = true;
    }
    ~Slot() {
      if (!held_) return;
      std::lock_guard<std::mutex> l(slots_->mu_);
      --slots_->open_[client_];
    }
    Slot(const Slot&) = delete;
    Slot& operator=(const Slot&) = delete;
    bool held() const { return held_; }

   private:
    CallSlots* slots_;
    std::string client_;
    bool held_ = false;
  };

 private:
  const int per_client_;
  std::mutex mu_;
  std::map<std::string, int> open_;  // by client; guarded by mu_
};

}  // namespace meridian::rpc

#endif  // MERIDIAN_RPC_CALL_SLOTS_H_
