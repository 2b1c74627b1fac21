// llmpar/core/error.hpp — the one error macro family.
//
// Every check in llmpar throws llmpar::Error carrying file:line, the failed expression
// and a message built from any streamable values, so the message can name the value
// and the fix ("--heads 12 does not divide --dim 100; pick a dim that is a multiple
// of 12"). Examples catch it in main and exit non-zero with what() printed.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
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

template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

template <class... Args>
[[noreturn]] void throw_error(const char* file, int line, const char* expr, Args&&... args) {
  std::string where = concat(file, ":", line, ": ");
  std::string what = concat(std::forward<Args>(args)...);
  if (expr != nullptr) what += concat(" [check failed: ", expr, "]");
  throw Error(where + what, file, line);
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
