#pragma once
// A piece of a global tensor: the hyper-rectangle (Box) of the global tensor that one rank holds.
// Every layout meshtorch has is such a box: a TP chunk along dim 0 or 1, FSDP's row block of that
// chunk (the last ranks' rows clipped, possibly to none), a replica holding everything. The box
// algebra (intersect, subtract, copy the overlap) is what lets a checkpoint saved in one layout
// load into another: a rank fills its box from every saved piece that overlaps it.
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/error.hpp>
#include <meshtorch/layout/row_block.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::io {

struct Box {
  std::vector<std::int64_t> offsets, sizes;  // per dim; a 0-d tensor's box has no dims

  std::size_t dim() const { return sizes.size(); }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto s : sizes) n *= s;
    return n;
  }
  bool empty() const { return numel() == 0; }
  friend bool operator==(const Box&, const Box&) = default;
};

// "[0:4, 8:16]": half-open ranges per dim, as errors show a box.
MESHTORCH_DECL std::string to_string(const Box& box);

// The box of a whole tensor of this shape.
inline Box whole(const std::vector<std::int64_t>& shape) {
  return Box{std::vector<std::int64_t>(shape.size(), 0), shape};
}

inline bool contains(const Box& outer, const Box& inner) {
  if (outer.dim() != inner.dim()) return false;
  for (std::size_t d = 0; d < outer.dim(); ++d)
    if (inner.offsets[d] < outer.offsets[d] || inner.offsets[d] + inner.sizes[d] > outer.offsets[d] + outer.sizes[d])
      return false;
  return true;
}

// The common part of two boxes of the same tensor, or nothing when they do not overlap.
MESHTORCH_DECL std::optional<Box> intersect(const Box& a, const Box& b);

// `a` minus `b` as disjoint boxes (at most two per dim): what of `a` a piece `b` leaves uncovered.
MESHTORCH_DECL std::vector<Box> subtract(const Box& a, const Box& b);

// What of `region` none of `pieces` covers, as disjoint boxes; at most `limit` of them (a
// hostile manifest could split the rest into many), then the first `limit`.
MESHTORCH_DECL std::vector<Box> uncovered(const Box& region, const std::vector<Box>& pieces, std::size_t limit = 64);

// Two of `pieces` (indices) that share an element, or nothing. A sweep along dim 0 over the
// pieces sorted by offset, testing each against those whose rows it meets: linear for row
// blocks and TP x FSDP grids, never the all-pairs test.
MESHTORCH_DECL std::optional<std::pair<std::size_t, std::size_t>> first_overlap(const std::vector<Box>& pieces);

// Chunk `index` of `count` along `dim` of `box`, with torch.chunk's sizes (ceil(size / count)
// per chunk, the last ones shorter or empty): what TensorParallel keeps of a weight.
MESHTORCH_DECL Box chunk(const Box& box, std::int64_t dim, std::int64_t index, std::int64_t count);

inline Box chunk(const std::vector<std::int64_t>& global_shape, std::int64_t dim, std::int64_t index,
                 std::int64_t count) {
  return chunk(whole(global_shape), dim, index, count);
}

// Rows [begin, end) of `box` (dim 0, counted inside the box; clipped to the box): the block of a
// box that FSDP keeps on one rank, whose last ranks may hold fewer rows or none.
MESHTORCH_DECL Box rows(const Box& box, std::int64_t begin, std::int64_t end);

// `tensor` (whose extent is `box`) narrowed to the sub-box `part`; a view, no copy.
inline torch::Tensor view_of(const torch::Tensor& tensor, const Box& box, const Box& part) {
  auto view = tensor;
  for (std::size_t d = 0; d < box.dim(); ++d)
    view = view.narrow(static_cast<std::int64_t>(d), part.offsets[d] - box.offsets[d], part.sizes[d]);
  return view;
}

// Copies the overlap of `source` (extent `source_box`) into `target` (extent `target_box`);
// returns the overlap, or nothing when the boxes do not meet. Devices and strides may differ.
MESHTORCH_DECL std::optional<Box> copy_overlap(const torch::Tensor& source, const Box& source_box,
                                               torch::Tensor& target, const Box& target_box);

// One rank's piece of a global tensor, as checkpoints save and load it.
struct ShardedTensor {
  std::string name;
  torch::Tensor local;  // shape == box.sizes, any device; filled in place on load
  std::vector<std::int64_t> global_shape;
  Box box;             // where `local` sits in the global tensor
  bool writer = true;  // false for a replica that another rank saves
};

// A piece whose box must lie inside the global shape and match the local tensor's shape.
MESHTORCH_DECL ShardedTensor sharded(std::string name, torch::Tensor local, std::vector<std::int64_t> global_shape,
                                     Box box, bool writer = true);

// A whole tensor held by this rank; `writer` marks the one replica (of identical copies) that saves it.
inline ShardedTensor replicated(std::string name, torch::Tensor tensor, bool writer) {
  auto shape = tensor.sizes().vec();
  return sharded(std::move(name), std::move(tensor), shape, whole(shape), writer);
}

}  // namespace meshtorch::io

#if MESHTORCH_DEFINES(core)
#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace meshtorch::io {

MESHTORCH_DECL std::string to_string(const Box& box) {
  std::vector<std::string> ranges;
  for (std::size_t d = 0; d < box.dim(); ++d)
    ranges.push_back(fmt::format("{}:{}", box.offsets[d], box.offsets[d] + box.sizes[d]));
  return fmt::format("[{}]", fmt::join(ranges, ", "));
}

MESHTORCH_DECL std::optional<Box> intersect(const Box& a, const Box& b) {
  if (a.dim() != b.dim())
    throw ConfigError(
        fmt::format("intersect: boxes {} and {} have different numbers of dims", to_string(a), to_string(b)));
  Box out;
  for (std::size_t d = 0; d < a.dim(); ++d) {
    const auto begin = std::max(a.offsets[d], b.offsets[d]);
    const auto end = std::min(a.offsets[d] + a.sizes[d], b.offsets[d] + b.sizes[d]);
    if (end <= begin) return std::nullopt;
    out.offsets.push_back(begin);
    out.sizes.push_back(end - begin);
  }
  if (a.empty() || b.empty()) return std::nullopt;
  return out;
}

MESHTORCH_DECL std::vector<Box> subtract(const Box& a, const Box& b) {
  const auto common = intersect(a, b);
  if (!common) return a.empty() ? std::vector<Box>{} : std::vector<Box>{a};
  std::vector<Box> out;
  Box rest = a;  // shrinks dim by dim to the intersection
  for (std::size_t d = 0; d < a.dim(); ++d) {
    const auto rest_end = rest.offsets[d] + rest.sizes[d];
    const auto common_end = common->offsets[d] + common->sizes[d];
    if (common->offsets[d] > rest.offsets[d]) {
      Box below = rest;
      below.sizes[d] = common->offsets[d] - rest.offsets[d];
      out.push_back(below);
    }
    if (common_end < rest_end) {
      Box above = rest;
      above.offsets[d] = common_end;
      above.sizes[d] = rest_end - common_end;
      out.push_back(above);
    }
    rest.offsets[d] = common->offsets[d];
    rest.sizes[d] = common->sizes[d];
  }
  return out;
}

MESHTORCH_DECL std::vector<Box> uncovered(const Box& region, const std::vector<Box>& pieces, std::size_t limit) {
  std::vector<Box> left;
  if (!region.empty()) left.push_back(region);
  for (const auto& piece : pieces) {
    std::vector<Box> next;
    for (const auto& part : left)
      for (auto& rest : subtract(part, piece)) next.push_back(std::move(rest));
    left = std::move(next);
    if (left.size() > limit) left.resize(limit);  // reported as "the first `limit`", not an exact list
  }
  return left;
}

MESHTORCH_DECL std::optional<std::pair<std::size_t, std::size_t>> first_overlap(const std::vector<Box>& pieces) {
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < pieces.size(); ++i)
    if (!pieces[i].empty()) order.push_back(i);
  if (!order.empty() && pieces[order.front()].dim() == 0)
    return order.size() > 1 ? std::optional(std::pair(order[0], order[1])) : std::nullopt;
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return pieces[a].offsets[0] < pieces[b].offsets[0]; });
  std::vector<std::size_t> active;  // pieces whose rows reach the current piece's first row
  for (const auto i : order) {
    const auto begin = pieces[i].offsets[0];
    std::erase_if(active, [&](std::size_t a) { return pieces[a].offsets[0] + pieces[a].sizes[0] <= begin; });
    for (const auto a : active)
      if (intersect(pieces[a], pieces[i])) return std::pair(a, i);
    active.push_back(i);
  }
  return std::nullopt;
}

MESHTORCH_DECL Box chunk(const Box& box, std::int64_t dim, std::int64_t index, std::int64_t count) {
  if (dim < 0 || dim >= static_cast<std::int64_t>(box.dim()))
    throw ConfigError(fmt::format("chunk: dim {} is out of range for box {}", dim, to_string(box)));
  if (count < 1 || index < 0 || index >= count)
    throw ConfigError(fmt::format("chunk: index {} of {} chunks is out of range", index, count));
  const auto block = row_block(box.sizes[dim], count, index);
  Box out = box;
  out.offsets[dim] += block.first;
  out.sizes[dim] = block.count;
  return out;
}

MESHTORCH_DECL Box rows(const Box& box, std::int64_t begin, std::int64_t end) {
  if (box.dim() == 0) throw ConfigError("rows: a 0-d box has no rows");
  if (begin < 0 || end < begin)
    throw ConfigError(fmt::format("rows: [{}, {}) is not a row range of box {}", begin, end, to_string(box)));
  begin = std::min(begin, box.sizes[0]);
  end = std::min(end, box.sizes[0]);
  Box out = box;
  out.offsets[0] += begin;
  out.sizes[0] = end - begin;
  return out;
}

MESHTORCH_DECL std::optional<Box> copy_overlap(const torch::Tensor& source, const Box& source_box,
                                               torch::Tensor& target, const Box& target_box) {
  const auto common = intersect(source_box, target_box);
  if (!common) return std::nullopt;
  torch::NoGradGuard no_grad;
  view_of(target, target_box, *common).copy_(view_of(source, source_box, *common));
  return common;
}

MESHTORCH_DECL ShardedTensor sharded(std::string name, torch::Tensor local, std::vector<std::int64_t> global_shape,
                                     Box box, bool writer) {
  if (box.dim() != global_shape.size() || !contains(whole(global_shape), box))
    throw ConfigError(fmt::format("{}: box {} does not lie inside the global shape [{}]", name, to_string(box),
                                  fmt::join(global_shape, ", ")));
  if (local.sizes().vec() != box.sizes)
    throw ConfigError(fmt::format("{}: the local tensor has shape [{}] but its box {} has sizes [{}]", name,
                                  fmt::join(local.sizes(), ", "), to_string(box), fmt::join(box.sizes, ", ")));
  return ShardedTensor{std::move(name), std::move(local), std::move(global_shape), std::move(box), writer};
}

}  // namespace meshtorch::io
#endif  // MESHTORCH_DEFINES(core)
