#pragma once
// JoinedWork: one c10d work made of several issued together, complete when all of them are.
// What Work<Result> (comm/work.hpp) and the flight recorder see as one collective when a backend
// has no single call for it (FSDP's all-gather on Gloo is one broadcast per rank, see
// parallel/fsdp.hpp). c10d has no such class: its Work::create_from_future cannot wait with a
// timeout, which every wait on Gloo needs.
#include <algorithm>
#include <chrono>
#include <exception>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/Work.hpp>

namespace meshtorch::comm {

class JoinedWork final : public c10d::Work {
 public:
  explicit JoinedWork(std::vector<c10::intrusive_ptr<c10d::Work>> parts) : parts_(std::move(parts)) {}

  bool isCompleted() override {
    return std::ranges::all_of(parts_, [](const auto& part) { return part->isCompleted(); });
  }

  bool isSuccess() const override {
    return std::ranges::all_of(parts_, [](const auto& part) { return part->isSuccess(); });
  }

  std::exception_ptr exception() const override {
    for (const auto& part : parts_)
      if (auto failure = part->exception()) return failure;
    return nullptr;
  }

  // Waits for each part in turn within one deadline: `timeout` bounds the whole, as it bounds a
  // single collective. A part's failure or timeout is thrown by its own wait.
  bool wait(std::chrono::milliseconds timeout = ::kNoTimeout) override {
    using std::chrono::milliseconds;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (auto& part : parts_) {
      if (timeout == ::kNoTimeout) {
        part->wait();
        continue;
      }
      const auto left = std::chrono::duration_cast<milliseconds>(deadline - std::chrono::steady_clock::now());
      // c10d reads a timeout of 0 as none: a deadline already passed still gets a bounded wait.
      part->wait(std::max(left, milliseconds(1)));
    }
    return true;
  }

  void synchronize() override {
    for (auto& part : parts_) part->synchronize();
  }

  void abort() override {
    for (auto& part : parts_) part->abort();
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> parts_;
};

}  // namespace meshtorch::comm
