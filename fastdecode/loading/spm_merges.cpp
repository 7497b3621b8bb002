// `tokenizers`' BPE for a SentencePiece vocabulary whose merges are implied by the vocabulary (tokenizer.implied_merges:
// every split of a token into two tokens, ranked by the token's priority, then the longer left piece, the longer right
// piece, then vocabulary order), with the merges found in the vocabulary itself instead of listed: `tokenizers` took
// 0.5 s to build Gemma 3's 515k merges into its BPE, this table takes 0.05 s.
//
// merge(): the ids `tokenizers` gives with no merges (one symbol per character, byte-fallback and added tokens as they
// come) -> the ids its BPE with the implied merges gives. encode(): the same for Gemma's whole pipeline, from text.
// The loop is Word::merge_all's (tokenizers/src/models/bpe/word.rs): a min-heap of (rank, position, new id); an entry
// whose pair no longer merges into that id is dropped; a merge pushes the new pairs with both neighbours. Merging never
// crosses an added token (tokenizers splits them out before the model runs), so ids are merged in runs between them.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <queue>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

class ImpliedMerges {
 public:
  // tokens: the vocabulary by id (as the BPE holds it); level[u], for the u-th distinct token in id order of first
  // appearance: its priority's rank, 0 = merged first; boundary: the added tokens' ids.
  ImpliedMerges(std::vector<std::string> tokens, const std::vector<int32_t>& level, const std::vector<int64_t>& boundary,
                std::vector<std::string> added, const std::vector<int64_t>& added_ids, int64_t unk_id)
      : tokens_(std::move(tokens)), chars_(tokens_.size()), is_boundary_(tokens_.size(), false),
        seed_(std::random_device{}() | static_cast<uint64_t>(std::random_device{}()) << 32),
        added_(std::move(added)), added_index_(0, Hasher{seed_}), unk_id_(unk_id) {
    size_t slots = 16;
    while (slots < 2 * tokens_.size()) slots *= 2;
    slots_.assign(slots, {0, -1});
    for (size_t id = 0; id < tokens_.size(); ++id) {
      const std::string_view t = tokens_[id];
      // a dict of the tokens: a repeated string keeps its first place (u) and takes its last id
      const uint64_t h = hash(t, seed_);
      size_t at = h & (slots_.size() - 1);
      while (slots_[at].u >= 0 && !(slots_[at].hash == h && tokens_[distinct_[slots_[at].u].first] == t))
        at = (at + 1) & (slots_.size() - 1);
      if (slots_[at].u < 0) {
        slots_[at] = {h, static_cast<int32_t>(distinct_.size())};
        distinct_.push_back({0, 0, static_cast<int32_t>(id)});
      }
      distinct_[slots_[at].u].id = static_cast<int32_t>(id);
      int64_t n = 0;  // characters (code points), as Python counts them
      for (const unsigned char c : t) n += (c & 0xC0) != 0x80;
      chars_[id] = static_cast<int32_t>(n);
    }
    if (level.size() != distinct_.size()) throw std::invalid_argument("one level per distinct token is needed");
    for (size_t u = 0; u < distinct_.size(); ++u) distinct_[u].level = level[u];
    for (const int64_t id : boundary)
      if (0 <= id && id < static_cast<int64_t>(is_boundary_.size())) is_boundary_[id] = true;
    if (added_ids.size() != added_.size()) throw std::invalid_argument("one id per added token is needed");
    for (size_t i = 0; i < added_.size(); ++i) {
      if (added_[i].empty()) continue;
      added_index_.emplace(added_[i], added_ids[i]);
      added_lengths_[static_cast<unsigned char>(added_[i][0])].push_back(added_[i].size());
    }
    for (auto& lengths : added_lengths_) {
      std::sort(lengths.begin(), lengths.end(), std::greater<size_t>());
      lengths.erase(std::unique(lengths.begin(), lengths.end()), lengths.end());
    }
    char name[8];
    for (int b = 0; b < 256; ++b) {
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      const int32_t u = lookup(name);
      byte_id_[b] = u < 0 ? -1 : distinct_[u].id;
    }
  }

  // The whole of `tokenizers`' encode for Gemma's pipeline (added tokens not normalized, then the normalizer " " ->
  // "\u2581", no pre-tokenizer, BPE with byte fallback, then BOS / EOS): leftmost-longest added tokens (its
  // Aho-Corasick's match kind), each piece between them one word of characters merged as merge() does.
  std::vector<int64_t> encode(const std::string& text, int64_t bos, int64_t eos) const {
    std::vector<int64_t> out, word;
    if (bos >= 0) out.push_back(bos);
    std::string piece;
    const auto flush = [&] {
      symbols(piece, word);
      merge_run(word.data(), word.size(), out);
      piece.clear();
    };
    for (size_t i = 0; i < text.size();) {
      int64_t id = -1;
      size_t len = 0;
      for (const size_t n : added_lengths_[static_cast<unsigned char>(text[i])]) {
        if (n > text.size() - i) continue;
        const auto it = added_index_.find(std::string_view(text).substr(i, n));
        if (it != added_index_.end()) {
          id = it->second, len = n;
          break;
        }
      }
      if (id >= 0) {
        flush();
        out.push_back(id);
        i += len;
      } else if (text[i] == ' ') {
        piece += "\u2581";
        ++i;
      } else {
        piece += text[i++];
      }
    }
    flush();
    if (eos >= 0) out.push_back(eos);
    return out;
  }

  std::vector<int64_t> merge(const std::vector<int64_t>& ids) const {
    std::vector<int64_t> out;
    out.reserve(ids.size());
    size_t i = 0;
    while (i < ids.size()) {
      size_t j = i;
      while (j < ids.size() && !is_boundary(ids[j])) ++j;
      merge_run(ids.data() + i, j - i, out);
      if (j < ids.size()) out.push_back(ids[j++]);  // an added token, as it is
      i = j;
    }
    return out;
  }

 private:
  struct Token {
    int32_t level, id, first;  // id: the last id the string has; first: its first
  };
  struct Slot {
    uint64_t hash;
    int32_t u;  // -1: empty
  };
  struct Hasher {
    uint64_t seed;
    size_t operator()(std::string_view s) const { return hash(s, seed); }
  };

  // Seeded per table: the vocabulary comes from a file, and one whose strings were chosen to collide in a fixed hash
  // would make every lookup walk them all (a load that never ends).
  static uint64_t hash(std::string_view s, uint64_t seed) {
    uint64_t h = (seed ^ s.size()) * 0x9E3779B97F4A7C15ull;
    size_t i = 0;
    for (; i + 8 <= s.size(); i += 8) {
      uint64_t w;
      std::memcpy(&w, s.data() + i, 8);
      h = (h ^ w) * 0xFF51AFD7ED558CCDull;
      h ^= h >> 32;
    }
    uint64_t w = 0;
    std::memcpy(&w, s.data() + i, s.size() - i);
    h = (h ^ w) * 0xC4CEB9FE1A85EC53ull;
    return h ^ (h >> 29);
  }

  // The distinct token spelled s: its u, or -1.
  int32_t lookup(std::string_view s) const {
    const uint64_t h = hash(s, seed_);
    for (size_t at = h & (slots_.size() - 1);; at = (at + 1) & (slots_.size() - 1)) {
      const Slot& slot = slots_[at];
      if (slot.u < 0) return -1;
      if (slot.hash == h && tokens_[distinct_[slot.u].first] == s) return slot.u;
    }
  }
  struct Symbol {
    int64_t id, prev, next;
    bool alive;
  };
  struct Merge {
    // the rank's sort key (level, longer left, longer right, vocabulary order), then the position
    int32_t level, left_chars, right_chars, u;
    int64_t pos, new_id;
    bool operator>(const Merge& o) const {
      if (level != o.level) return level > o.level;
      if (left_chars != o.left_chars) return left_chars < o.left_chars;
      if (right_chars != o.right_chars) return right_chars < o.right_chars;
      if (u != o.u) return u > o.u;
      return pos > o.pos;
    }
  };

  // A word's characters -> its symbols, as BPE::merge_word makes them: a character's token, else its bytes' <0xXX>
  // tokens (all of them or none), else the unknown token, a run of unknown characters fused into one.
  void symbols(const std::string& w, std::vector<int64_t>& out) const {
    out.clear();
    bool unk_pending = false;
    for (size_t i = 0; i < w.size();) {
      const unsigned char c = w[i];
      const size_t n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
      const std::string_view ch = std::string_view(w).substr(i, n);
      i += n;
      const int32_t u = lookup(ch);
      if (u >= 0) {
        if (unk_pending) out.push_back(unk_id_), unk_pending = false;
        out.push_back(distinct_[u].id);
        continue;
      }
      bool bytes = true;
      for (const unsigned char b : ch) bytes = bytes && byte_id_[b] >= 0;
      if (bytes) {  // (a pending unknown token stays pending, after these, as in merge_word)
        for (const unsigned char b : ch) out.push_back(byte_id_[b]);
        continue;
      }
      if (unk_id_ < 0) throw std::invalid_argument("a character is not in the vocabulary, which has no unknown token");
      unk_pending = true;
    }
    if (unk_pending) out.push_back(unk_id_);
  }

  bool is_boundary(int64_t id) const {
    return id < 0 || id >= static_cast<int64_t>(tokens_.size()) || is_boundary_[id];
  }

  // A call's pairs already looked up (a text repeats its pairs): direct-mapped, (a, b) -> u of a + b, or -1.
  struct PairMemo {
    std::vector<uint64_t> key;
    std::vector<int32_t> u;
    std::string scratch;
    explicit PairMemo(size_t n) {
      size_t size = 64;
      while (size < n && size < 16384) size *= 2;
      key.assign(size, ~0ull);
      u.resize(size);
    }
  };

  // Whether tokens a and b merge (both non-empty, their concatenation a token): the merge, at position pos.
  bool find(int64_t a, int64_t b, int64_t pos, PairMemo& memo, Merge& m) const {
    const uint64_t k = static_cast<uint64_t>(a) << 32 | static_cast<uint64_t>(b);
    const size_t at = ((k * 0x9E3779B97F4A7C15ull) >> 40) & (memo.key.size() - 1);
    int32_t u;
    if (memo.key[at] == k) {
      u = memo.u[at];
    } else {
      const std::string& x = tokens_[a];
      const std::string& y = tokens_[b];
      u = x.empty() || y.empty() ? -1 : lookup(memo.scratch.assign(x).append(y));
      memo.key[at] = k, memo.u[at] = u;
    }
    if (u < 0) return false;
    m = {distinct_[u].level, chars_[a], chars_[b], u, pos, distinct_[u].id};
    return true;
  }

  void merge_run(const int64_t* ids, size_t n, std::vector<int64_t>& out) const {
    PairMemo memo(n);  // per call: calls run on several threads at once (the GIL is released)
    std::vector<Symbol> s(n);
    for (size_t k = 0; k < n; ++k)
      s[k] = {ids[k], static_cast<int64_t>(k) - 1, k + 1 < n ? static_cast<int64_t>(k) + 1 : -1, true};
    std::priority_queue<Merge, std::vector<Merge>, std::greater<Merge>> heap;
    Merge m;
    for (size_t k = 0; k + 1 < n; ++k)
      if (find(s[k].id, s[k + 1].id, k, memo, m)) heap.push(m);
    while (!heap.empty()) {
      const Merge top = heap.top();
      heap.pop();
      Symbol& left = s[top.pos];
      if (!left.alive || left.next < 0) continue;
      Symbol& right = s[left.next];
      // a stale entry: the pair at pos changed since, into one that does not merge into this id
      if (!find(left.id, right.id, top.pos, memo, m) || m.new_id != top.new_id) continue;
      left.id = top.new_id;
      right.alive = false;
      left.next = right.next;
      if (right.next >= 0) s[right.next].prev = top.pos;
      if (left.prev >= 0 && find(s[left.prev].id, left.id, left.prev, memo, m)) heap.push(m);
      if (left.next >= 0 && find(left.id, s[left.next].id, top.pos, memo, m)) heap.push(m);
    }
    for (size_t k = 0; k < n; ++k)
      if (s[k].alive) out.push_back(s[k].id);
  }

  std::vector<std::string> tokens_;
  std::vector<int32_t> chars_;
  std::vector<bool> is_boundary_;
  std::vector<Token> distinct_;
  std::vector<Slot> slots_;  // open addressing: a distinct token's hash -> u
  uint64_t seed_;
  std::vector<std::string> added_;
  std::unordered_map<std::string_view, int64_t, Hasher> added_index_;
  std::vector<size_t> added_lengths_[256];  // by first byte, longest first
  int64_t byte_id_[256];
  int64_t unk_id_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<ImpliedMerges>(m, "ImpliedMerges")
      .def(py::init<std::vector<std::string>, const std::vector<int32_t>&, const std::vector<int64_t>&,
                    std::vector<std::string>, const std::vector<int64_t>&, int64_t>(),
           py::arg("tokens"), py::arg("level"), py::arg("boundary"), py::arg("added"), py::arg("added_ids"),
           py::arg("unk_id"))
      .def("encode", &ImpliedMerges::encode, py::arg("text"), py::arg("bos"), py::arg("eos"),
           py::call_guard<py::gil_scoped_release>(),
           "text -> ids, Gemma's whole pipeline (bos, eos: -1 for none)")
      .def("merge", &ImpliedMerges::merge, py::arg("ids"), py::call_guard<py::gil_scoped_release>(),
           "ids tokenizers' BPE gives without merges -> the ids it gives with the implied merges");
}
