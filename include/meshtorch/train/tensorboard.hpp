#pragma once
// Experiment tracking in TensorBoard's event files, which TensorBoard reads directly and W&B
// imports (`wandb sync --sync-tensorboard <folder>`): every metric of metrics.jsonl as a scalar at
// its global_step, the run's flags as text, and a "session start" at a resumed step so that
// TensorBoard drops the steps logged after the checkpoint by the run that stopped.
//
// The file is TFRecord: each record is its length (uint64, little-endian), the masked CRC-32C of
// the length, the bytes, and the masked CRC-32C of the bytes (Boost.CRC's CRC-32C); each record is
// a tensorflow.Event in protobuf's wire format, of the schema below (the subset of TensorBoard's
// event.proto, summary.proto and tensor.proto that we write, with their field numbers).
//
// Why the few messages are encoded here and not through libprotobuf: Debian's libsentencepiece,
// which the examples link for tokenizer.model, carries its own copy of protobuf-lite with exported
// symbols, and a process that also loads libprotobuf 3.21 crashes before main() (libprotobuf's
// static initialisers call into sentencepiece's copy). The encoder below writes only varints,
// fixed-width numbers and length-delimited fields; the tests decode its output with libprotobuf over
// `event_schema` (tests/core, a process without sentencepiece) and with the tensorboard package's
// reader (tests/examples).
//
// Which ranks write (--tracking-ranks), as the guide's W&B modes: rank0 (one run), node (local
// rank 0 of each node, one run per node: tensorboard/node-<k>), all (tensorboard/rank-<r>).
//
// Link requirements: Boost headers (CMake target meshtorch::tracking).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include <meshtorch/comm/env.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>
#include <meshtorch/train/args.hpp>  // TrainArgs::fingerprint(), the flags written as text
#include <meshtorch/train/metrics.hpp>

namespace meshtorch::train {

namespace tensorboard_detail {

// What the writer below encodes, as TensorBoard's .proto files declare it (the tests decode the
// files with libprotobuf over this text).
inline constexpr std::string_view event_schema = R"pb(
  syntax = "proto3"
  ;
package tensorflow;

enum DataType {
  DT_INVALID = 0;
  DT_FLOAT = 1;
  DT_STRING = 7;
}
message TensorShapeProto {
  message Dim {
    int64 size = 1;
    string name = 2;
  }
  repeated Dim dim = 2;
  bool unknown_rank = 3;
}
message TensorProto {
  DataType dtype = 1;
  TensorShapeProto tensor_shape = 2;
  repeated float float_val = 5 [packed = true];
  repeated bytes string_val = 8;
}
enum DataClass {
  DATA_CLASS_UNKNOWN = 0;
  DATA_CLASS_SCALAR = 1;
  DATA_CLASS_TENSOR = 2;
  DATA_CLASS_BLOB_SEQUENCE = 3;
}
message SummaryMetadata {
  message PluginData {
    string plugin_name = 1;
    bytes content = 2;
  }
  PluginData plugin_data = 1;
  string display_name = 2;
  string summary_description = 3;
  DataClass data_class = 4;
}
message Summary {
  message Value {
    string node_name = 7;
    string tag = 1;
    SummaryMetadata metadata = 9;
    oneof value {
      float simple_value = 2;
      TensorProto tensor = 8;
    }
  }
  repeated Value value = 1;
}
message SessionLog {
  enum SessionStatus {
    STATUS_UNSPECIFIED = 0;
    START = 1;
    STOP = 2;
    CHECKPOINT = 3;
  }
  SessionStatus status = 1;
  string checkpoint_path = 2;
  string msg = 3;
}
message Event {
  double wall_time = 1;
  int64 step = 2;
  oneof what {
    string file_version = 3;
    Summary summary = 5;
    SessionLog session_log = 7;
  }
}
)pb";

// A protobuf message in wire format, field by field; defined with the definitions below, which
// alone write messages.
class WireMessage;

// The field numbers of `event_schema` that we write.
struct fields {
  static constexpr int event_wall_time = 1, event_step = 2, event_file_version = 3, event_summary = 5,
                       event_session_log = 7;
  static constexpr int summary_value = 1;
  static constexpr int value_tag = 1, value_simple_value = 2, value_tensor = 8, value_metadata = 9;
  static constexpr int metadata_plugin_data = 1, metadata_data_class = 4, plugin_data_plugin_name = 1;
  static constexpr int tensor_dtype = 1, tensor_tensor_shape = 2, tensor_string_val = 8;
  static constexpr int session_log_status = 1;
  static constexpr int dt_string = 7, data_class_tensor = 2, session_start = 1;  // enum values
};

// TFRecord's masked CRC-32C (the Castagnoli polynomial, reflected): a CRC stored beside the data
// it covers is rotated and offset so that a CRC of CRCs is not trivially zero.
MESHTORCH_DECL std::uint32_t masked_crc32c(const void* data, std::size_t size);

}  // namespace tensorboard_detail

// One event file of one run: events.out.tfevents.<seconds>.<host>.<pid>.<n> in `run_dir`, appended
// record by record and flushed after each, so TensorBoard shows a run while it trains.
class EventFileWriter {
  using fields = tensorboard_detail::fields;

 public:
  explicit EventFileWriter(const std::filesystem::path& run_dir);
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;
  ~EventFileWriter();

  const std::filesystem::path& path() const { return path_; }

  // Scalars at `step`, one Summary.Value (tag, simple_value) each.
  void add_scalars(std::int64_t step, const std::vector<std::pair<std::string, double>>& scalars);

  // Markdown shown in TensorBoard's Text tab: a scalar string tensor tagged for the text plugin.
  void add_text(std::int64_t step, const std::string& tag, const std::string& markdown);

  // The run (re)starts at `step`: TensorBoard discards what this run folder holds for later steps.
  void add_session_start(std::int64_t step);

 private:
  static tensorboard_detail::WireMessage event(std::int64_t step);

  void write(const tensorboard_detail::WireMessage& event);

  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
};

enum class TrackingRanks { rank0, node, all };

MESHTORCH_DECL TrackingRanks parse_tracking_ranks(const std::string& text);

// This rank's run folder under <experiment>/tensorboard, or nullopt when it does not write:
// rank0 -> the folder itself on rank 0; node -> node-<k> on each node's local rank 0 (k = rank /
// ranks per node, as launchers number nodes); all -> rank-<r> on every rank.
MESHTORCH_DECL std::optional<std::filesystem::path> tensorboard_run_dir(const std::filesystem::path& experiment_dir,
                                                                        TrackingRanks ranks, int rank, int local_rank,
                                                                        int local_world_size);

// The Experiment's tracker for --tensorboard: on a rank that writes (`run_dir`), the run's flags
// as text when it starts, a session start at a resumed step, and every numeric field of each
// metrics record as a scalar; on the others, nothing.
class TensorBoardTracker final : public MetricsTracker {
 public:
  TensorBoardTracker(const std::optional<std::filesystem::path>& run_dir, const std::string& flags);

  // The event file this rank writes, if any.
  std::optional<std::filesystem::path> path() const { return writer_ ? std::optional(writer_->path()) : std::nullopt; }

  void on_start(std::int64_t global_step) override {
    if (writer_ && global_step > 0) writer_->add_session_start(global_step);
  }

  void on_metrics(const nlohmann::ordered_json& record) override;

 private:
  std::optional<EventFileWriter> writer_;
};

// What an example passes to its Experiment: with --tensorboard, a tracker on every rank (writing
// on the ranks --tracking-ranks names); without it, nullptr. --tensorboard needs -e.
MESHTORCH_DECL std::unique_ptr<MetricsTracker> tensorboard_tracker(const TrainArgs& args, int rank);

}  // namespace meshtorch::train

#if MESHTORCH_DEFINES(tracking)
#include <unistd.h>

#include <bit>
#include <cstring>

#include <boost/crc.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace meshtorch::train {

namespace tensorboard_detail {

// A protobuf message in wire format, field by field (proto3: fields at their default are omitted
// by the caller, as protobuf itself omits them).
class WireMessage {
 public:
  WireMessage& varint(int field, std::uint64_t value) {
    key(field, 0);
    put_varint(value);
    return *this;
  }
  WireMessage& fixed64(int field, std::uint64_t bits) {
    key(field, 1);
    put_little_endian(bits, 8);
    return *this;
  }
  WireMessage& fixed32(int field, std::uint32_t bits) {
    key(field, 5);
    put_little_endian(bits, 4);
    return *this;
  }
  WireMessage& float64(int field, double value) { return fixed64(field, std::bit_cast<std::uint64_t>(value)); }
  WireMessage& float32(int field, float value) { return fixed32(field, std::bit_cast<std::uint32_t>(value)); }
  WireMessage& bytes(int field, std::string_view value) {
    key(field, 2);
    put_varint(value.size());
    bytes_.append(value);
    return *this;
  }
  WireMessage& message(int field, const WireMessage& value) { return bytes(field, value.bytes_); }

  const std::string& str() const { return bytes_; }

 private:
  void key(int field, int wire_type) { put_varint(static_cast<std::uint64_t>(field) << 3 | wire_type); }
  void put_varint(std::uint64_t value) {
    for (; value >= 0x80; value >>= 7) bytes_.push_back(static_cast<char>(value | 0x80));
    bytes_.push_back(static_cast<char>(value));
  }
  void put_little_endian(std::uint64_t value, int width) {
    for (int i = 0; i < width; ++i) bytes_.push_back(static_cast<char>(value >> (8 * i)));
  }

  std::string bytes_;
};

MESHTORCH_DECL std::uint32_t masked_crc32c(const void* data, std::size_t size) {
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc;
  crc.process_bytes(data, size);
  const std::uint32_t value = crc.checksum();
  return ((value >> 15) | (value << 17)) + 0xa282ead8u;
}

}  // namespace tensorboard_detail

MESHTORCH_DECL EventFileWriter::EventFileWriter(const std::filesystem::path& run_dir) {
  std::error_code error;
  std::filesystem::create_directories(run_dir, error);
  if (error)
    throw DataError(
        fmt::format("{}: cannot create the TensorBoard run folder ({})", run_dir.string(), error.message()));
  const auto seconds =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  // A restart within the same second gets the next number, never another run's file.
  for (int n = 0;; ++n) {
    path_ = run_dir / fmt::format("events.out.tfevents.{}.{}.{}.{}", seconds, comm::host_name(), ::getpid(), n);
    if (!std::filesystem::exists(path_)) break;
  }
  file_ = std::fopen(path_.c_str(), "wb");
  if (!file_) throw DataError(fmt::format("{}: cannot create ({})", path_.string(), std::strerror(errno)));
  write(event(0).bytes(fields::event_file_version, "brain.Event:2"));
}

MESHTORCH_DECL EventFileWriter::~EventFileWriter() {
  if (file_) std::fclose(file_);
}

MESHTORCH_DECL void EventFileWriter::add_scalars(std::int64_t step,
                                                 const std::vector<std::pair<std::string, double>>& scalars) {
  tensorboard_detail::WireMessage summary;
  for (const auto& [tag, value] : scalars)
    summary.message(fields::summary_value, tensorboard_detail::WireMessage()
                                               .bytes(fields::value_tag, tag)
                                               .float32(fields::value_simple_value, static_cast<float>(value)));
  write(event(step).message(fields::event_summary, summary));
}

MESHTORCH_DECL void EventFileWriter::add_text(std::int64_t step, const std::string& tag, const std::string& markdown) {
  using tensorboard_detail::WireMessage;
  const auto metadata =
      WireMessage()
          .message(fields::metadata_plugin_data, WireMessage().bytes(fields::plugin_data_plugin_name, "text"))
          .varint(fields::metadata_data_class, fields::data_class_tensor);
  const auto tensor = WireMessage()
                          .varint(fields::tensor_dtype, fields::dt_string)
                          .message(fields::tensor_tensor_shape, WireMessage())  // no dimensions: a scalar
                          .bytes(fields::tensor_string_val, markdown);
  const auto value = WireMessage()
                         .bytes(fields::value_tag, tag)
                         .message(fields::value_metadata, metadata)
                         .message(fields::value_tensor, tensor);
  write(event(step).message(fields::event_summary, WireMessage().message(fields::summary_value, value)));
}

MESHTORCH_DECL void EventFileWriter::add_session_start(std::int64_t step) {
  write(event(step).message(fields::event_session_log, tensorboard_detail::WireMessage().varint(
                                                           fields::session_log_status, fields::session_start)));
}

MESHTORCH_DECL tensorboard_detail::WireMessage EventFileWriter::event(std::int64_t step) {
  const std::chrono::duration<double> now = std::chrono::system_clock::now().time_since_epoch();
  tensorboard_detail::WireMessage message;
  message.float64(fields::event_wall_time, now.count());
  if (step != 0) message.varint(fields::event_step, static_cast<std::uint64_t>(step));
  return message;
}

MESHTORCH_DECL void EventFileWriter::write(const tensorboard_detail::WireMessage& event) {
  const std::string& data = event.str();
  const std::uint64_t length = data.size();  // little-endian on the platforms LibTorch supports
  const std::uint32_t length_crc = tensorboard_detail::masked_crc32c(&length, sizeof length);
  const std::uint32_t data_crc = tensorboard_detail::masked_crc32c(data.data(), data.size());
  const bool written = std::fwrite(&length, sizeof length, 1, file_) == 1 &&
                       std::fwrite(&length_crc, sizeof length_crc, 1, file_) == 1 &&
                       std::fwrite(data.data(), 1, data.size(), file_) == data.size() &&
                       std::fwrite(&data_crc, sizeof data_crc, 1, file_) == 1 && std::fflush(file_) == 0;
  if (!written) throw DataError(fmt::format("{}: writing an event failed ({})", path_.string(), std::strerror(errno)));
}

MESHTORCH_DECL TrackingRanks parse_tracking_ranks(const std::string& text) {
  if (text == "rank0") return TrackingRanks::rank0;
  if (text == "node") return TrackingRanks::node;
  if (text == "all") return TrackingRanks::all;
  throw ConfigError(fmt::format("--tracking-ranks '{}': use rank0, node or all", text));
}

MESHTORCH_DECL std::optional<std::filesystem::path> tensorboard_run_dir(const std::filesystem::path& experiment_dir,
                                                                        TrackingRanks ranks, int rank, int local_rank,
                                                                        int local_world_size) {
  const auto root = experiment_dir / "tensorboard";
  switch (ranks) {
    case TrackingRanks::rank0:
      return rank == 0 ? std::optional(root) : std::nullopt;
    case TrackingRanks::node:
      return local_rank == 0 ? std::optional(root / fmt::format("node-{}", rank / local_world_size)) : std::nullopt;
    case TrackingRanks::all:
      return root / fmt::format("rank-{}", rank);
  }
  return std::nullopt;
}

MESHTORCH_DECL TensorBoardTracker::TensorBoardTracker(const std::optional<std::filesystem::path>& run_dir,
                                                      const std::string& flags) {
  if (!run_dir) return;
  writer_.emplace(*run_dir);
  writer_->add_text(0, "flags", "```\n" + flags + "```");
}

MESHTORCH_DECL void TensorBoardTracker::on_metrics(const nlohmann::ordered_json& record) {
  if (!writer_) return;
  std::vector<std::pair<std::string, double>> scalars;
  for (const auto& [key, value] : record.items())
    if (key != "global_step" && value.is_number()) scalars.emplace_back(key, value.get<double>());
  writer_->add_scalars(record.at("global_step").get<std::int64_t>(), scalars);
}

MESHTORCH_DECL std::unique_ptr<MetricsTracker> tensorboard_tracker(const TrainArgs& args, int rank) {
  const auto ranks = parse_tracking_ranks(args.tracking_ranks);
  if (!args.tensorboard) return nullptr;
  if (args.experiment_name.empty())
    throw ConfigError("--tensorboard: the event files go to <save-dir>/<experiment>/tensorboard; give -e");
  const auto launch = comm::launch_env();
  return std::make_unique<TensorBoardTracker>(
      tensorboard_run_dir(std::filesystem::path(args.save_dir) / args.experiment_name, ranks, rank, launch.local_rank,
                          launch.local_world_size),
      args.fingerprint());
}

}  // namespace meshtorch::train
#endif  // MESHTORCH_DEFINES(tracking)
