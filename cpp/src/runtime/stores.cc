// Rendezvous stores: in-process (a hash map), a directory (Gloo's FileStore;
// processes on one host), and a pair of set/get callbacks.
#include <fmt/format.h>
#include <gloo/rendezvous/file_store.h>

#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "baton/runtime.h"

namespace baton::runtime {

namespace {

class HashStore : public Store {
 public:
  void set(const std::string& key, const std::string& value) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      map_[key] = value;
    }
    cv_.notify_all();
  }
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return map_.count(key) > 0; }))
      throw ExecutionError(
          fmt::format("store: timed out after {} ms waiting for key '{}'", timeout.count(), key));
    return map_[key];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> map_;
};

class FileStoreWrap : public Store {
 public:
  explicit FileStoreWrap(const std::string& dir) : fs_(dir) {}
  void set(const std::string& key, const std::string& value) override {
    fs_.set(key, std::vector<char>(value.begin(), value.end()));
  }
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override {
    try {
      fs_.wait({key}, timeout);
    } catch (const std::exception& e) {
      throw ExecutionError(fmt::format("store: timed out after {} ms waiting for key '{}': {}",
                                       timeout.count(), key, e.what()));
    }
    auto v = fs_.get(key);
    return std::string(v.begin(), v.end());
  }

 private:
  gloo::rendezvous::FileStore fs_;
};

class CallbackStore : public Store {
 public:
  CallbackStore(std::function<void(const std::string&, const std::string&)> s,
                std::function<std::string(const std::string&, std::chrono::milliseconds)> g)
      : set_(std::move(s)), get_(std::move(g)) {}
  void set(const std::string& key, const std::string& value) override { set_(key, value); }
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override {
    return get_(key, timeout);
  }

 private:
  std::function<void(const std::string&, const std::string&)> set_;
  std::function<std::string(const std::string&, std::chrono::milliseconds)> get_;
};

}  // namespace

std::shared_ptr<Store> make_hash_store() { return std::make_shared<HashStore>(); }
std::shared_ptr<Store> make_file_store(const std::string& dir) {
  return std::make_shared<FileStoreWrap>(dir);
}
std::shared_ptr<Store> make_callback_store(
    std::function<void(const std::string&, const std::string&)> set,
    std::function<std::string(const std::string&, std::chrono::milliseconds)> get) {
  return std::make_shared<CallbackStore>(std::move(set), std::move(get));
}

}  // namespace baton::runtime
