// SPDX-License-Identifier: GPL-2.0-or-later
// Shared helpers of the qcow2 unit tests.
#pragma once

#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "qcow2/error.h"
#include "qcow2/image.h"
#include "tests/unit/image_builder.h"

namespace qcommit::test {

inline std::unique_ptr<qcow2::Image> open_image(const ImageBuilder& b, const std::string& name = "mem.qcow2") {
  return qcow2::Image::open(b.device(name));
}

inline std::unique_ptr<qcow2::Image> open_bytes(std::vector<uint8_t> bytes,
                                                const std::string& name = "mem.qcow2") {
  return qcow2::Image::open(std::make_unique<qcow2::MemoryDevice>(name, std::move(bytes)));
}

// Runs f, which must throw E (or a subclass) whose message names `file` and contains `needle`.
template <class E>
void expect_error(const std::function<void()>& f, const std::string& file, const std::string& needle) {
  bool thrown = false;
  try {
    f();
  } catch (const E& e) {
    thrown = true;
    const std::string msg = e.what();
    INFO("message: " << msg);
    CHECK(msg.rfind(file + ": ", 0) == 0);
    CHECK(msg.find(needle) != std::string::npos);
    CHECK(msg.find('\n') == std::string::npos);
  } catch (const std::exception& e) {
    FAIL("wrong exception type, message: " << e.what());
  }
  if (!thrown) FAIL("no exception; expected one naming " << file << " and mentioning '" << needle << "'");
}

// A scratch directory removed at the end of the test.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::string templ = (std::filesystem::temp_directory_path() / "qcommit-unit.XXXXXX").string();
    path = mkdtemp(templ.data());
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
  std::string write(const std::string& name, const std::vector<uint8_t>& bytes) const {
    std::ofstream f(file(name), std::ios::binary);
    f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    return file(name);
  }
};

}  // namespace qcommit::test
