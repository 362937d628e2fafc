// core::remove_tree: removes a whole tree bottom-up, counts what it removed,
// removes a symbolic link without following it, treats a missing path as
// nothing to do, and reports a path it cannot reach with its errno.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include "tests/support/temp_dir.h"
#include "troupe/runtime/core/files.h"
#include "troupe/runtime/core/process.h"

namespace fs = std::filesystem;

namespace troupe::core {
namespace {

// A program whose file was replaced while it ran (a rebuild, an upgrade in
// place) reads "PATH (deleted)" from /proc/self/exe: workers it started then
// were sent to exec that text and failed ("cannot run .../troupe-train
// (deleted)"), spending a job's max_failures in milliseconds. The path is
// the file there now; the text stays as it is when no file is there, or
// when a file has that very name.
TEST(SelfExecutable, AReplacedProgramsPathIsTheFileThereNow) {
  const auto dir = troupe::test::fresh_dir("self-exe");
  const std::string prog = (dir / "prog").string();
  std::ofstream(prog) << "new build";
  EXPECT_EQ(executable_from_link(prog), prog);
  EXPECT_EQ(executable_from_link(prog + " (deleted)"), prog);
  const std::string gone = (dir / "gone").string() + " (deleted)";
  EXPECT_EQ(executable_from_link(gone), gone);
  const std::string odd = (dir / "odd (deleted)").string();
  std::ofstream(odd) << "a file with that name";
  std::ofstream((dir / "odd").string()) << "";
  EXPECT_EQ(executable_from_link(odd), odd);
  EXPECT_EQ(executable_from_link(" (deleted)"), " (deleted)");
}

void touch(const fs::path& p) { std::ofstream(p) << "x"; }

TEST(RemoveTreeTest, RemovesNestedTreesAndCountsEntries) {
  auto root = test::fresh_dir("remove-tree");
  fs::create_directories(root / "a" / "b" / "c");
  touch(root / "a" / "f1");
  touch(root / "a" / "b" / "f2");
  touch(root / "a" / "b" / "c" / "f3");
  std::error_code ec;
  // a, b, c, three files.
  EXPECT_EQ(remove_tree(root / "a", ec), 6u);
  EXPECT_FALSE(ec) << ec.message();
  EXPECT_FALSE(fs::exists(root / "a"));
  EXPECT_TRUE(fs::exists(root));
  // A single file, and a missing path (nothing to do, no error).
  touch(root / "lone");
  EXPECT_EQ(remove_tree(root / "lone"), 1u);
  EXPECT_EQ(remove_tree(root / "never-was", ec), 0u);
  EXPECT_FALSE(ec);
  remove_tree(root);
  EXPECT_FALSE(fs::exists(root));
}

TEST(RemoveTreeTest, RemovesALinkNotWhatItPointsTo) {
  auto root = test::fresh_dir("remove-tree-link");
  fs::create_directories(root / "kept");
  touch(root / "kept" / "precious");
  fs::create_directories(root / "doomed");
  fs::create_directory_symlink(root / "kept", root / "doomed" / "link");
  EXPECT_EQ(remove_tree(root / "doomed"), 2u);
  EXPECT_TRUE(fs::exists(root / "kept" / "precious"));
  // Named with a trailing separator, a link to a directory is still the
  // link: its target keeps what it holds.
  fs::create_directory_symlink(root / "kept", root / "alias");
  EXPECT_EQ(remove_tree(root.string() + "/alias/"), 1u);
  EXPECT_FALSE(fs::is_symlink(root / "alias"));
  EXPECT_TRUE(fs::exists(root / "kept" / "precious"));
  remove_tree(root);
}

TEST(RemoveTreeTest, ReportsAPathItCannotReach) {
  auto root = test::fresh_dir("remove-tree-bad");
  touch(root / "file");
  std::error_code ec;
  // A path through a regular file: ENOTDIR, whoever runs the test.
  EXPECT_EQ(remove_tree(root / "file" / "child", ec), 0u);
  EXPECT_EQ(ec, std::errc::not_a_directory) << ec.message();
  try {
    remove_tree(root / "file" / "child");
    FAIL() << "no error for a path through a file";
  } catch (const fs::filesystem_error& e) {
    EXPECT_NE(std::string(e.what()).find("child"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::exists(root / "file"));
  remove_tree(root);
}

}  // namespace
}  // namespace troupe::core
