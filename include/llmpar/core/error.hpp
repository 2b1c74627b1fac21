// llmpar/core/error.hpp — the one error macro family.
//
// Every check in llmpar throws llmpar::Error carrying file:line, the failed expression
// and a message built from any streamable values, so the message can name the value
// and the fix ("--heads 12 does not divide --dim 100; pick a dim that is a multiple
// of 12"). Examples catch it in main and exit non-zero with what() printed.
#pragma once

#include <charconv>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "llmpar/config.hpp"

namespace llmpar {

class Error : public std::runtime_error {
 public:
  Error(std::string message, const char* file, int line)
      : std::runtime_error(std::move(message)), file_(file), line_(line) {}
  const char* file() const noexcept { return file_; }
  int line() const noexcept { return line_; }

 private:
  const char* file_;
  int line_;
};

namespace detail {

// A piece of a message appended as an ostream would print it, but without one where the
// type allows (text, characters, integers; floating point goes through one shared
// stream function): every message shape instantiates concat_parts, so it stays small.
LLMPAR_COLD inline void append_floating(std::string& out, double v) {
  std::ostringstream os;
  os << v;
  out += os.str();
}

template <class Int>
void append_integer(std::string& out, Int v) {
  char digits[24];
  const auto end = std::to_chars(digits, digits + sizeof digits, v).ptr;
  out.append(digits, end);
}

template <class T>
void append(std::string& out, const T& v) {
  if constexpr (std::is_convertible_v<const T&, const char*>) {
    if (const char* text = v; text != nullptr) out += text;
  } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    out += std::string_view(v);
  } else if constexpr (std::is_same_v<T, bool>) {
    out += v ? '1' : '0';
  } else if constexpr (std::is_same_v<T, char> || std::is_same_v<T, signed char> || std::is_same_v<T, unsigned char>) {
    out += static_cast<char>(v);
  } else if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) {
    append_integer(out, static_cast<long long>(v));
  } else if constexpr (std::is_integral_v<T>) {
    append_integer(out, static_cast<unsigned long long>(v));
  } else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    append_floating(out, v);
  } else {
    std::ostringstream os;
    os << v;
    out += os.str();
  }
}

template <class... Parts>
std::string concat_parts(const Parts&... parts) {
  std::string out;
  (append(out, parts), ...);
  return out;
}

// A message part in its canonical type, so that messages of one shape share one
// instantiation of throw_parts whatever the lengths of their literals or the widths of
// their integers: text becomes const char* or string_view, integers (long) long, floating
// point double; other types (bool and the characters, which print as themselves, among
// them) stay as they are, by reference.
template <class T>
decltype(auto) part(const T& v) {
  constexpr bool kCharacter = std::is_same_v<T, bool> || std::is_same_v<T, char> || std::is_same_v<T, signed char> ||
                              std::is_same_v<T, unsigned char>;
  if constexpr (std::is_convertible_v<const T&, const char*>) {
    return static_cast<const char*>(v);
  } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    return std::string_view(v);
  } else if constexpr (std::is_integral_v<T> && !kCharacter && std::is_signed_v<T>) {
    return static_cast<long long>(v);
  } else if constexpr (std::is_integral_v<T> && !kCharacter) {
    return static_cast<unsigned long long>(v);
  } else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    return static_cast<double>(v);
  } else {
    return static_cast<const T&>(v);
  }
}

// The message `os << args...` would print.
template <class... Args>
std::string concat(const Args&... args) {
  return concat_parts(part(args)...);
}

// The throw itself, out of line: one copy per program rather than one per message.
[[noreturn]] LLMPAR_COLD inline void raise_error(const char* file, int line, const char* expr, std::string what) {
  std::string message = concat(file, ":", line, ": ", what);
  if (expr != nullptr) message += concat(" [check failed: ", expr, "]");
  throw Error(std::move(message), file, line);
}

// One instantiation per canonical message shape; cold, so the compiler keeps it small
// and out of the checked function's hot path.
template <class... Parts>
[[noreturn]] LLMPAR_COLD void throw_parts(const char* file, int line, const char* expr, const Parts&... parts) {
  raise_error(file, line, expr, concat_parts(parts...));
}

template <class... Args>
[[noreturn]] inline void throw_error(const char* file, int line, const char* expr, const Args&... args) {
  throw_parts(file, line, expr, part(args)...);
}

}  // namespace detail
}  // namespace llmpar

// LLMPAR_CHECK(cond, message parts...): throws llmpar::Error when cond is false.
#define LLMPAR_CHECK(cond, ...)                                              \
  do {                                                                       \
    if (!(cond)) [[unlikely]]                                                \
      ::llmpar::detail::throw_error(__FILE__, __LINE__, #cond, __VA_ARGS__); \
  } while (0)

// LLMPAR_FAIL(message parts...): throws unconditionally (unreachable configurations).
#define LLMPAR_FAIL(...) ::llmpar::detail::throw_error(__FILE__, __LINE__, nullptr, __VA_ARGS__)
