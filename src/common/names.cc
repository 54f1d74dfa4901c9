#include "common/names.h"

#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ckpt {
namespace {

constexpr size_t kMaxQuotedBytes = 128;

absl::string_view AV(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// Decodes one well-formed UTF-8 sequence at s[i]. Returns its length in bytes
// and sets *cp, or returns 0 if the bytes at s[i] are not well-formed UTF-8
// (truncated, overlong, surrogate, above U+10FFFF, stray continuation byte).
size_t DecodeUtf8(std::string_view s, size_t i, uint32_t* cp) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b0 = byte(i);
  if (b0 < 0x80) {
    *cp = b0;
    return 1;
  }
  size_t len;
  uint32_t value;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
    value = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3;
    value = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;  // overlong
    if (b0 == 0xED) hi = 0x9F;  // surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4;
    value = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;  // overlong
    if (b0 == 0xF4) hi = 0x8F;  // above U+10FFFF
  } else {
    return 0;
  }
  if (i + len > s.size()) return 0;
  for (size_t k = 1; k < len; ++k) {
    const unsigned char b = byte(i + k);
    const unsigned char min = k == 1 ? lo : 0x80;
    const unsigned char max = k == 1 ? hi : 0xBF;
    if (b < min || b > max) return 0;
    value = (value << 6) | (b & 0x3F);
  }
  *cp = value;
  return len;
}

bool IsControl(uint32_t cp) { return cp < 0x20 || cp == 0x7F || (cp >= 0x80 && cp <= 0x9F); }

// The character of `s` starting at offset i (one byte if that is not
// well-formed UTF-8), escaped as QuoteForMessage() would, in single quotes.
std::string DescribeCharAt(std::string_view s, size_t i) {
  uint32_t cp = 0;
  size_t len = DecodeUtf8(s, i, &cp);
  if (len == 0) len = 1;
  std::string quoted = QuoteForMessage(s.substr(i, len));
  // Swap the double quotes for single ones: 'x'.
  quoted.front() = '\'';
  quoted.back() = '\'';
  if (quoted == "'\\\"'") quoted = "'\"'";
  return quoted;
}

// Shared validator of job ids and node ids. `what` is "job id" / "node id",
// `plural` "job ids" / "node ids", `pattern` the human-readable rule.
absl::Status ValidateId(std::string_view id, bool allow_upper, size_t max_len,
                        std::string_view what, std::string_view plural, std::string_view pattern) {
  const auto fail = [&](std::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(AV(what), " ", QuoteForMessage(id), " is invalid: ", AV(why), "; ", AV(plural),
                     " must match ", AV(pattern), " and must not contain \"..\""));
  };
  const auto alnum = [&](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
           (allow_upper && c >= 'A' && c <= 'Z');
  };
  if (id.empty()) return fail("it is empty");
  if (id.size() > max_len) {
    return fail(absl::StrFormat("it is %d bytes long, at most %d are allowed", id.size(), max_len));
  }
  if (id.find("..") != std::string_view::npos) return fail("it contains \"..\"");
  if (!alnum(id[0])) {
    return fail(absl::StrCat("it starts with ", DescribeCharAt(id, 0), ", which is not in ",
                             allow_upper ? "[A-Za-z0-9]" : "[a-z0-9]"));
  }
  for (size_t i = 1; i < id.size(); ++i) {
    const char c = id[i];
    if (alnum(c) || c == '.' || c == '_' || c == '-') continue;
    return fail(
        absl::StrCat("character ", DescribeCharAt(id, i), " at offset ", i, " is not allowed"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string QuoteForMessage(std::string_view value) {
  std::string out = "\"";
  size_t i = 0;
  while (i < value.size()) {
    uint32_t cp = 0;
    size_t len = DecodeUtf8(value, i, &cp);
    if (i + (len == 0 ? 1 : len) > kMaxQuotedBytes) break;
    if (len == 0 || IsControl(cp)) {
      const unsigned char b = static_cast<unsigned char>(value[i]);
      if (b == '\n') {
        out += "\\n";
      } else if (b == '\r') {
        out += "\\r";
      } else if (b == '\t') {
        out += "\\t";
      } else {
        // A C1 control (2 bytes) or a stray byte: escape each byte.
        const size_t n = len == 0 ? 1 : len;
        for (size_t k = 0; k < n; ++k) {
          absl::StrAppendFormat(&out, "\\x%02x", static_cast<unsigned char>(value[i + k]));
        }
      }
      i += len == 0 ? 1 : len;
      continue;
    }
    if (cp == '"' || cp == '\\') out += '\\';
    out.append(value.substr(i, len));
    i += len;
  }
  out += '"';
  if (i < value.size()) absl::StrAppend(&out, "... (", value.size(), " bytes)");
  return out;
}

absl::Status ValidateJobId(std::string_view job_id) {
  return ValidateId(job_id, /*allow_upper=*/false, kMaxJobIdLength, "job id", "job ids",
                    "[a-z0-9][a-z0-9._-]{0,62}");
}

absl::Status ValidateNodeId(std::string_view node_id) {
  return ValidateId(node_id, /*allow_upper=*/true, kMaxNodeIdLength, "node id", "node ids",
                    "[A-Za-z0-9][A-Za-z0-9._-]{0,62}");
}

absl::Status ValidateHostNodeId(std::string_view node_id, std::string_view host, std::string_view what) {
  const std::string w(what);
  if (host.empty()) return absl::InvalidArgumentError(w + ": a DPU agent must name the host it serves");
  if (absl::Status s = ValidateNodeId(host); !s.ok()) {
    return absl::InvalidArgumentError(w + ": " + std::string(s.message()));
  }
  if (host == node_id) {
    return absl::InvalidArgumentError(w + ": a DPU agent needs a node id of its own, not its host's");
  }
  return absl::OkStatus();
}

absl::Status ValidateItemName(std::string_view name) {
  const auto fail = [&](std::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("item name ", QuoteForMessage(name), " is invalid: ", AV(why),
                     "; item names must be 1 to 1024 bytes of well-formed UTF-8 without control "
                     "characters"));
  };
  if (name.empty()) return fail("it is empty");
  if (name.size() > kMaxItemNameLength) {
    return fail(absl::StrFormat("it is %d bytes long, at most %d are allowed", name.size(),
                                kMaxItemNameLength));
  }
  // Printable ASCII (nearly every name) needs no decoding.
  size_t i = 0;
  while (i < name.size() && static_cast<unsigned char>(name[i]) - 0x20u < 0x5Fu) ++i;
  while (i < name.size()) {
    uint32_t cp = 0;
    const size_t len = DecodeUtf8(name, i, &cp);
    if (len == 0) {
      return fail(absl::StrFormat("byte 0x%02x at offset %d is not well-formed UTF-8",
                                  static_cast<unsigned char>(name[i]), i));
    }
    if (IsControl(cp)) {
      return fail(absl::StrFormat("control character U+%04X at offset %d", cp, i));
    }
    i += len;
  }
  return absl::OkStatus();
}

absl::Status ValidatePathComponent(std::string_view component) {
  const auto fail = [&](std::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "path component ", QuoteForMessage(component), " is invalid: ", AV(why),
        "; a path component must be 1 to 255 bytes, not \".\" or \"..\", and contain no "
        "'/' or NUL"));
  };
  if (component.empty()) return fail("it is empty");
  if (component == "." || component == "..") return fail("it is a relative reference");
  if (component.size() > kMaxPathComponentLength) {
    return fail(absl::StrFormat("it is %d bytes long", component.size()));
  }
  if (const size_t pos = component.find('/'); pos != std::string_view::npos) {
    return fail(absl::StrFormat("it contains '/' at offset %d", pos));
  }
  if (const size_t pos = component.find('\0'); pos != std::string_view::npos) {
    return fail(absl::StrFormat("it contains NUL at offset %d", pos));
  }
  return absl::OkStatus();
}

namespace {

template <typename Range>
absl::StatusOr<std::string> JoinUnderRootImpl(std::string_view root, const Range& components) {
  if (root.empty()) return absl::InvalidArgumentError("path root is empty");
  if (root.find('\0') != std::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("path root ", QuoteForMessage(root), " is invalid: it contains NUL"));
  }
  while (root.size() > 1 && root.back() == '/') root.remove_suffix(1);
  std::string path(root);
  size_t index = 0;
  for (const auto& c : components) {
    const std::string_view component(c);
    if (absl::Status s = ValidatePathComponent(component); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("cannot join under ", QuoteForMessage(root),
                                                     ": component ", index, " of ",
                                                     components.size(), ": ", s.message()));
    }
    if (path.back() != '/') path += '/';
    path.append(component);
    ++index;
  }
  return path;
}

}  // namespace

absl::StatusOr<std::string> JoinUnderRoot(std::string_view root,
                                          std::initializer_list<std::string_view> components) {
  return JoinUnderRootImpl(root, components);
}

absl::StatusOr<std::string> JoinUnderRoot(std::string_view root,
                                          std::span<const std::string> components) {
  return JoinUnderRootImpl(root, components);
}

absl::Status ValidateStep(uint64_t step) {
  if (step <= kMaxStep) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "step ", step, " is out of range: steps must be 0..", kMaxStep,
      " (2^53-1, exact in JSON and Python floats)"));
}

std::string RankFileName(uint32_t rank) { return absl::StrFormat("rank-%05u.bin", rank); }

}  // namespace ckpt
