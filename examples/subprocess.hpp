// subprocess.hpp — how the example tools (llmpar-plan --validate, llmpar-scaling) run
// train_gpt: one program beside the tool, its arguments quoted, its output to a log.
#pragma once

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace tools {

// The program `name` in the directory of the running one (the build puts the examples
// side by side).
inline std::string beside_this_program(const char* argv0, const char* name) {
  std::error_code ec;
  const auto self = std::filesystem::canonical("/proc/self/exe", ec);
  return ((ec ? std::filesystem::path(argv0).parent_path() : self.parent_path()) / name).string();
}

// Single quotes for the shell, a quote inside closed, escaped and reopened.
inline std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Runs `exe` with `args`, stdout and stderr into `log`; true when it exited with 0.
inline bool run_program(const std::string& exe, const std::vector<std::string>& args, const std::string& log) {
  std::string cmd = shell_quote(exe);
  for (const std::string& a : args) cmd += " " + shell_quote(a);
  cmd += " > " + shell_quote(log) + " 2>&1";
  const int rc = std::system(cmd.c_str());
  return rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0;
}

}  // namespace tools
