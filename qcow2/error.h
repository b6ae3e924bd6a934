// SPDX-License-Identifier: GPL-2.0-or-later
// Error types of the qcow2 library. Every message names the file it is about, so the CLI can
// print it as one line: "qcommit: <file>: <problem>".
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace qcommit::qcow2 {

// Base of everything the library throws on bad input or failed I/O.
class Error : public std::runtime_error {
 public:
  Error(std::string file, const std::string& problem)
      : std::runtime_error(file.empty() ? problem : file + ": " + problem),
        file_(std::move(file)),
        problem_(problem) {}
  [[nodiscard]] const std::string& file() const { return file_; }
  [[nodiscard]] const std::string& problem() const { return problem_; }

 private:
  std::string file_;
  std::string problem_;
};

// The operating system refused an operation (EIO, ENOSPC, ...).
class IoError : public Error {
 public:
  IoError(std::string file, const std::string& problem, int err)
      : Error(std::move(file), problem), errno_(err) {}
  [[nodiscard]] int error_number() const { return errno_; }

 private:
  int errno_;
};

// The image's metadata is inconsistent. Not an I/O error: the image gets marked corrupt (when we
// are allowed to write it) and no further writes are made.
class CorruptionError : public Error {
 public:
  using Error::Error;
};

// A valid image that uses something we do not implement (encryption, unknown feature bits).
class UnsupportedError : public Error {
 public:
  using Error::Error;
};

std::string hex(uint64_t v);

}  // namespace qcommit::qcow2
