#pragma once
// Who stalled a job, from what the ranks last reported: the watchdog runs this on the progress
// every rank publishes through the store, meshtorch-diagnose on the flight recorder dumps. It
// names (in this order of precedence)
//   - a desync: members of a group issued different collectives under one sequence number
//     ("rank 3 is in all_gather #812 over the FSDP group [0, 1, 2, 3] while ranks 0, 1, 2 are
//     in reduce_scatter #812"), or the same one on tensors of another shape or dtype (every
//     collective here needs the same on all members; NCCL would hang or corrupt, not refuse), as
//     PyTorch's flight-recorder analyser does;
//   - the ranks that did not arrive at a collective others wait in, following waits to their
//     root: a rank that waits itself is blocked by someone else, a rank that stopped reporting
//     progress or is in no collective at all is where the job is stuck;
// and for each culprit the last collective it took part in.
// Standard library, fmt and nlohmann-json only: the diagnose tool needs no LibTorch.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include <meshtorch/diagnostics/flight_recorder.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::diagnostics {

struct GroupProgress {
  std::string name;
  std::vector<int> ranks;
  std::uint64_t issued = 0, completed = 0;
  std::string op;  // of the collective `issued`
};

struct CollectiveRef {
  std::string group, op, state;
  std::uint64_t seq = 0;
  double seconds = -1;  // how long it has waited, where known
};

// What is known of one rank: its published progress (or its own dump), and whether it still
// answers (its progress reports advance, or it wrote a dump).
struct RankReport {
  int rank = -1;
  bool responsive = true;
  bool dumped = false;
  std::string fatal;  // "fatal signal SIGSEGV" when its dump was written on one
  std::map<std::string, GroupProgress> groups;
  std::optional<CollectiveRef> last, waiting;
  std::map<std::pair<std::string, std::uint64_t>, std::string> ops;  // from its ring: (group, seq) -> op
  // (group, seq) -> "float32[4, 8]": the tensor of that collective, where recorded.
  std::map<std::pair<std::string, std::uint64_t>, std::string> tensors;
};

struct HangVerdict {
  std::vector<int> culprits;
  std::string summary;               // one line
  std::vector<std::string> details;  // further lines, each a sentence

  MESHTORCH_DECL std::string text() const;
};

// A rank's report from its progress JSON (FlightRecorder::progress()).
MESHTORCH_DECL RankReport rank_report_from_progress(int rank, const nlohmann::json& progress);

// Adds a dump's ring (FlightRecorder::entries()) to the report: the op of every recorded
// sequence number, so a desync further back than the last collective is found too.
MESHTORCH_DECL void add_ring(RankReport& report, const nlohmann::json& entries);

// The reports of every rank from their dumps: a rank's own dump where it wrote one, else what
// the dumping ranks read of it from the store (and whether it still answered then).
MESHTORCH_DECL std::map<int, RankReport> rank_reports_from_dumps(const std::vector<nlohmann::json>& dumps);

// The verdict on the reports of every rank (see above): the culprits, a summary line and details.
MESHTORCH_DECL HangVerdict analyse_hang(const std::map<int, RankReport>& reports);

}  // namespace meshtorch::diagnostics

#if MESHTORCH_DEFINES(programs)
#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <set>
#include <string_view>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

namespace meshtorch::diagnostics {

MESHTORCH_DECL std::string HangVerdict::text() const {
  std::string out = summary;
  for (const auto& line : details) out += "\n  " + line;
  return out;
}

namespace detail {

MESHTORCH_DECL std::string ranks_phrase(const std::vector<int>& ranks) {
  if (ranks.size() == 1) return fmt::format("rank {}", ranks.front());
  return fmt::format("ranks {}", fmt::join(ranks, ", "));
}

MESHTORCH_DECL std::string describe_collective(const std::string& op, std::uint64_t seq, const std::string& group) {
  return fmt::format("{} #{} over the {}", op, seq, group);
}

MESHTORCH_DECL std::optional<std::string> op_at(const RankReport& report, const std::string& group, std::uint64_t seq) {
  if (auto found = report.ops.find({group, seq}); found != report.ops.end()) return found->second;
  if (auto g = report.groups.find(group); g != report.groups.end() && g->second.issued == seq && !g->second.op.empty())
    return g->second.op;
  return std::nullopt;
}

// "float32[4, 8]" from a ring entry or a progress report; empty when it names no tensor.
MESHTORCH_DECL std::string tensor_text(const nlohmann::json& entry) {
  const auto dtype = entry.value("dtype", "");
  if (dtype.empty() || !entry.contains("shape") || !entry["shape"].is_array()) return {};
  return fmt::format("{}[{}]", dtype, fmt::join(entry["shape"].get<std::vector<std::int64_t>>(), ", "));
}

MESHTORCH_DECL void add_tensor(RankReport& report, const nlohmann::json& entry) {
  if (auto text = tensor_text(entry); !text.empty())
    report.tensors[{entry.value("group", ""), entry.value("seq", std::uint64_t{0})}] = text;
}

// The peer (a global rank) of a send or receive the flight recorder recorded; none for a collective.
MESHTORCH_DECL std::optional<int> point_to_point_peer(std::string_view op) {
  for (const std::string_view prefix : {send_prefix, receive_prefix})
    if (op.substr(0, prefix.size()) == prefix) {
      int peer = -1;
      const auto rest = op.substr(prefix.size());
      if (std::from_chars(rest.data(), rest.data() + rest.size(), peer).ec == std::errc() && peer >= 0) return peer;
    }
  return std::nullopt;
}

MESHTORCH_DECL std::uint64_t issued_on(const RankReport& report, const std::string& group) {
  auto g = report.groups.find(group);
  return g == report.groups.end() ? 0 : g->second.issued;
}

}  // namespace detail

MESHTORCH_DECL RankReport rank_report_from_progress(int rank, const nlohmann::json& progress) {
  RankReport report;
  report.rank = rank;
  if (!progress.is_object()) return report;
  for (const auto& g : progress.value("groups", nlohmann::json::array())) {
    GroupProgress group;
    group.name = g.value("group", "");
    group.ranks = g.value("ranks", std::vector<int>{});
    group.issued = g.value("issued", std::uint64_t{0});
    group.completed = g.value("completed", std::uint64_t{0});
    group.op = g.value("op", "");
    report.groups[group.name] = group;
  }
  auto collective = [](const nlohmann::json& j) {
    CollectiveRef ref;
    ref.group = j.value("group", "");
    ref.op = j.value("op", "");
    ref.state = j.value("state", "");
    ref.seq = j.value("seq", std::uint64_t{0});
    ref.seconds = j.value("seconds", -1.0);
    return ref;
  };
  for (const char* key : {"last", "waiting"})
    if (progress.contains(key) && progress[key].is_object()) {
      (std::string(key) == "last" ? report.last : report.waiting) = collective(progress[key]);
      detail::add_tensor(report, progress[key]);
    }
  return report;
}

MESHTORCH_DECL void add_ring(RankReport& report, const nlohmann::json& entries) {
  if (!entries.is_array()) return;
  for (const auto& e : entries) {
    if (!e.is_object()) continue;
    report.ops[{e.value("group", ""), e.value("seq", std::uint64_t{0})}] = e.value("op", "");
    detail::add_tensor(report, e);
  }
}

MESHTORCH_DECL std::map<int, RankReport> rank_reports_from_dumps(const std::vector<nlohmann::json>& dumps) {
  std::map<int, RankReport> reports;
  for (const auto& dump : dumps) {
    const int rank = dump.value("rank", -1);
    if (rank < 0) continue;
    RankReport report = rank_report_from_progress(rank, dump.value("progress", nlohmann::json::object()));
    report.dumped = true;
    if (const std::string reason = dump.value("reason", ""); reason.rfind("fatal signal", 0) == 0)
      report.fatal = reason;
    add_ring(report, dump.value("entries", nlohmann::json::array()));
    reports[rank] = std::move(report);
  }
  for (const auto& dump : dumps) {
    if (!dump.contains("peers") || !dump["peers"].is_object()) continue;
    for (const auto& [key, peer] : dump["peers"].items()) {
      const int rank = std::atoi(key.c_str());
      auto found = reports.find(rank);
      if (found != reports.end() && found->second.dumped) continue;
      const bool responsive = peer.value("responsive", true);
      if (found == reports.end()) {
        RankReport report = rank_report_from_progress(rank, peer.value("progress", nlohmann::json()));
        report.responsive = responsive;
        reports[rank] = std::move(report);
      } else {
        found->second.responsive = found->second.responsive && responsive;
      }
    }
  }
  return reports;
}

MESHTORCH_DECL HangVerdict analyse_hang(const std::map<int, RankReport>& reports) {
  using detail::describe_collective;
  using detail::ranks_phrase;
  HangVerdict verdict;
  std::map<std::string, std::vector<int>> members;
  for (const auto& [rank, report] : reports)
    for (const auto& [name, group] : report.groups) members[name] = group.ranks;

  // 0. A rank that died of a signal: the others only wait for it.
  for (const auto& [rank, report] : reports) {
    if (report.fatal.empty()) continue;
    verdict.culprits.push_back(rank);
    std::string line = fmt::format("rank {} ended on a {}", rank, report.fatal);
    if (report.waiting)
      line += "; it was in " + describe_collective(report.waiting->op, report.waiting->seq, report.waiting->group);
    else if (report.last)
      line += "; its last collective was " + describe_collective(report.last->op, report.last->seq, report.last->group);
    (verdict.summary.empty() ? verdict.summary : verdict.details.emplace_back()) = line;
  }
  if (!verdict.culprits.empty()) return verdict;

  // 1. Desync: the lowest sequence number at which members of a group issued different ops.
  bool tensor_desync = false;
  for (const auto& [name, ranks] : members) {
    std::set<std::uint64_t> seqs;
    for (const auto& [rank, report] : reports) {
      for (const auto& [key, op] : report.ops)
        if (key.first == name) seqs.insert(key.second);
      if (auto issued = detail::issued_on(report, name)) seqs.insert(issued);
    }
    for (std::uint64_t seq : seqs) {
      // (op, tensor) -> ranks; the tensor ("Float[4, 8]") only where the ops agree.
      std::map<std::pair<std::string, std::string>, std::vector<int>> by_op;
      for (int r : ranks)
        if (auto report = reports.find(r); report != reports.end())
          if (auto op = detail::op_at(report->second, name, seq); op && !detail::point_to_point_peer(*op))
            by_op[{*op, ""}].push_back(r);  // a send and its receive differ by name, and are no desync
      if (by_op.size() == 1) {
        // One op: its members must all pass the same shape and dtype (where recorded).
        std::map<std::pair<std::string, std::string>, std::vector<int>> by_tensor;
        for (int r : by_op.begin()->second)
          if (auto t = reports.at(r).tensors.find({name, seq}); t != reports.at(r).tensors.end())
            by_tensor[{by_op.begin()->first.first, t->second}].push_back(r);
        if (by_tensor.size() > 1) {
          by_op = std::move(by_tensor);
          tensor_desync = true;
        }
      }
      if (by_op.size() < 2) continue;
      // The op most members issued is taken as the right one; on a tie, the lowest rank's.
      auto majority = by_op.begin();
      for (auto it = by_op.begin(); it != by_op.end(); ++it)
        if (it->second.size() > majority->second.size() ||
            (it->second.size() == majority->second.size() && it->second.front() < majority->second.front()))
          majority = it;
      auto on = [](const std::string& tensor) { return tensor.empty() ? tensor : " on " + tensor; };
      for (auto it = by_op.begin(); it != by_op.end(); ++it) {
        if (it == majority) continue;
        verdict.culprits.insert(verdict.culprits.end(), it->second.begin(), it->second.end());
        verdict.details.push_back(
            fmt::format("{} {} in {} #{} over the {}{} while {} {} in {} #{}{}", ranks_phrase(it->second),
                        it->second.size() == 1 ? "is" : "are", it->first.first, seq, name, on(it->first.second),
                        ranks_phrase(majority->second), majority->second.size() == 1 ? "is" : "are",
                        majority->first.first, seq, on(majority->first.second)));
      }
      break;
    }
  }
  if (!verdict.culprits.empty()) {
    std::sort(verdict.culprits.begin(), verdict.culprits.end());
    verdict.summary = (tensor_desync ? "desync: ranks issued a collective on tensors of different shapes or dtypes: "
                                     : "desync: ranks issued different collectives: ") +
                      verdict.details.front();
    verdict.details.erase(verdict.details.begin());
    return verdict;
  }

  // 2. Who has not arrived where others wait.
  struct Blocked {
    std::string group, op;
    std::uint64_t seq = 0;
    std::vector<int> waiters;
    double seconds = -1;
  };
  std::map<int, std::vector<int>> blocked_by;        // waiter -> ranks it waits for
  std::map<int, std::vector<Blocked>> missing_from;  // a rank that has not arrived -> where
  for (const auto& [rank, report] : reports) {
    if (!report.waiting) continue;
    const auto& w = *report.waiting;
    auto group = members.find(w.group);
    if (group == members.end()) continue;
    // A send or receive waits for its one peer; and its number counts this rank's own messages,
    // which other ranks' counts need not match (a pipeline's first and last stages differ).
    const std::optional<int> peer = detail::point_to_point_peer(w.op);
    for (int m : group->second) {
      if (m == rank || (peer && m != *peer)) continue;
      auto other = reports.find(m);
      if (!peer && other != reports.end() && detail::issued_on(other->second, w.group) >= w.seq) continue;
      blocked_by[rank].push_back(m);
      auto& places = missing_from[m];
      auto where = std::find_if(places.begin(), places.end(),
                                [&](const Blocked& b) { return b.group == w.group && b.seq == w.seq; });
      if (where == places.end()) where = places.insert(places.end(), Blocked{w.group, w.op, w.seq, {}, -1});
      where->waiters.push_back(rank);
      where->seconds = std::max(where->seconds, w.seconds);
    }
  }
  // Roots: a missing rank that does not answer, or answers but waits for no one.
  std::set<int> roots;
  for (const auto& [rank, where] : missing_from) {
    auto report = reports.find(rank);
    const bool waits_for_others = report != reports.end() && report->second.responsive && blocked_by.count(rank);
    if (!waits_for_others) roots.insert(rank);
  }
  for (const auto& [rank, report] : reports)
    if (!report.responsive) roots.insert(rank);

  for (int root : roots) {
    verdict.culprits.push_back(root);
    auto report = reports.find(root);
    std::string state;
    if (report == reports.end())
      state = "it never reported progress";
    else if (!report->second.responsive)
      state = "it stopped responding (its progress reports stopped)";
    else if (!report->second.waiting)
      state = "it answers but is in no collective (busy in computation, I/O or a store wait)";
    else
      state = "it waits in " + describe_collective(report->second.waiting->op, report->second.waiting->seq,
                                                   report->second.waiting->group);
    // Its last collective: what it published, or later what the waiters completed with it.
    std::optional<CollectiveRef> last;
    if (report != reports.end()) last = report->second.last;
    auto where = missing_from.find(root);
    if (where != missing_from.end() && where->second.front().seq > 1 &&
        !detail::point_to_point_peer(where->second.front().op)) {
      const auto& w = where->second.front();
      const std::uint64_t reached = w.seq - 1;
      const bool published_behind = report == reports.end() || detail::issued_on(report->second, w.group) < reached;
      if (published_behind || !last) {
        std::optional<std::string> op;
        for (int waiter : w.waiters)
          if (!op) op = detail::op_at(reports.at(waiter), w.group, reached);
        last = CollectiveRef{w.group, op.value_or("collective"), "completed", reached};
      }
    }
    const std::string last_text =
        last ? fmt::format("its last collective was {} ({})", describe_collective(last->op, last->seq, last->group),
                           last->state.empty() ? "state unknown" : last->state)
             : "it took part in no collective yet";
    std::string line;
    if (where != missing_from.end()) {
      std::vector<std::string> places;
      for (const auto& w : where->second)
        places.push_back(fmt::format(
            "{}{}, where {} {} waiting{}", detail::point_to_point_peer(w.op) ? "its side of " : "",
            describe_collective(w.op, w.seq, w.group), ranks_phrase(w.waiters), w.waiters.size() == 1 ? "is" : "are",
            w.seconds >= 0 ? fmt::format(" for {:.1f} s", w.seconds) : ""));
      line =
          fmt::format("rank {} did not arrive at {}; {}; {}", root, fmt::join(places, ", nor at "), state, last_text);
    } else {
      line = fmt::format("rank {}: {}; {}", root, state, last_text);
    }
    if (verdict.summary.empty())
      verdict.summary = line;
    else
      verdict.details.push_back(line);
  }
  // Ranks that wait only because of a culprit, for the record.
  for (const auto& [rank, report] : reports)
    if (report.waiting && !roots.count(rank))
      verdict.details.push_back(
          fmt::format("rank {} waits in {}{}", rank,
                      describe_collective(report.waiting->op, report.waiting->seq, report.waiting->group),
                      report.waiting->seconds >= 0 ? fmt::format(" ({:.1f} s)", report.waiting->seconds) : ""));
  if (verdict.summary.empty()) {
    auto waiter =
        std::find_if(reports.begin(), reports.end(), [](const auto& r) { return r.second.waiting.has_value(); });
    verdict.summary =
        waiter == reports.end()
            ? "no culprit found: every rank reported progress and none waits for a missing peer"
            : fmt::format(
                  "no rank is missing from {}, yet it has not completed: the network or a member's backend is "
                  "stuck (every member answers and has issued it)",
                  describe_collective(waiter->second.waiting->op, waiter->second.waiting->seq,
                                      waiter->second.waiting->group));
  }
  return verdict;
}

}  // namespace meshtorch::diagnostics
#endif  // MESHTORCH_DEFINES(programs)
