// Packing a directory (core/dir_pack.h): the files chosen are those the
// Python shim's runtime_env working_dir packs (the same tree and the same
// expected list as test_runtime_env.py's gitignore test, which git itself
// agrees with), the archive unpacks to the same bytes and modes, and a
// damaged or hostile archive is refused.
#include "troupe/runtime/core/dir_pack.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <iterator>
#include <map>

#include "tests/support/temp_dir.h"
#include "troupe/runtime/core/errors.h"

namespace {

namespace fs = std::filesystem;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_tree(const std::string& root, const std::map<std::string, std::string>& files) {
  for (const auto& [name, text] : files) {
    const fs::path p = fs::path(root) / name;
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << text;
  }
}

std::vector<std::string> names(const std::vector<troupe::core::PackedFile>& files) {
  std::vector<std::string> out;
  for (const auto& f : files) out.push_back(f.name);
  return out;
}

// test_runtime_env.py's _IGNORING and _KEPT.
const std::map<std::string, std::string> kIgnoring = {
    {".gitignore",
     "# a comment, then a blank line\n\n*.log\n!keep.log\nbuild/\n/out\ndocs/**/draft.md\nsecret?.txt\n*.py[co]\n"
     "\\#notes\ntrailing.txt   \ncache/*\n!cache/wanted\nlogs\n!logs/important.txt\n[z-a]\n"},
    {"sub/.gitignore", "*.txt\n!important.txt\n/local.md\n"},
    {".rayignore", "*.bin\n"},
    {"app.py", ""},
    {"app.pyc", ""},
    {"app.pyo", ""},
    {"app.pyd", ""},
    {"weights.bin", ""},
    {"run.log", ""},
    {"keep.log", ""},
    {"sub/deep/run.log", ""},
    {"sub/keep.log", ""},
    {"build/a.o", ""},
    {"sub/build/b.o", ""},
    {"lib/build", ""},
    {"out/x", ""},
    {"sub/out/y", ""},
    {"docs/draft.md", ""},
    {"docs/a/b/draft.md", ""},
    {"docs/final.md", ""},
    {"other/docs/draft.md", ""},
    {"secret1.txt", ""},
    {"secret12.txt", ""},
    {"#notes", ""},
    {"notes", ""},
    {"trailing.txt", ""},
    {"cache/junk", ""},
    {"cache/wanted", ""},
    {"logs/important.txt", ""},
    {"sub/notes.txt", ""},
    {"sub/important.txt", ""},
    {"sub/local.md", ""},
    {"sub/deep/local.md", ""},
    {"sub/deep/x.txt", ""},
};
const std::vector<std::string> kKept = {".gitignore",
                                        ".rayignore",
                                        "app.py",
                                        "app.pyd",
                                        "cache/wanted",
                                        "docs/final.md",
                                        "keep.log",
                                        "lib/build",
                                        "notes",
                                        "other/docs/draft.md",
                                        "secret12.txt",
                                        "sub/.gitignore",
                                        "sub/deep/local.md",
                                        "sub/important.txt",
                                        "sub/keep.log",
                                        "sub/out/y"};

class DirPackTest : public ::testing::Test {
 protected:
  DirPackTest() : root_(troupe::test::make_temp_dir("dirpack")) {}
  ~DirPackTest() override { troupe::test::remove_dir(root_); }
  std::string root_;
};

TEST_F(DirPackTest, IgnoreFilesLeaveOutWhatGitWould) {
  write_tree(root_ + "/project", kIgnoring);
  fs::create_directories(root_ + "/project/__pycache__");
  std::ofstream(root_ + "/project/__pycache__/x.pyc") << "cache";
  fs::create_directories(root_ + "/project/.git");
  std::ofstream(root_ + "/project/.git/HEAD") << "ref";
  EXPECT_EQ(names(troupe::core::files_to_pack(root_ + "/project", {})), kKept);
  // Packing sub/ alone reads its own ignore file, not its parent's.
  EXPECT_EQ(names(troupe::core::files_to_pack(root_ + "/project/sub", {})),
            (std::vector<std::string>{".gitignore", "build/b.o", "deep/local.md", "deep/run.log", "important.txt",
                                      "keep.log", "out/y"}));
  // Without the .gitignore files, only .rayignore's *.bin goes.
  std::vector<std::string> everything;
  for (const auto& [name, text] : kIgnoring)
    if (name != "weights.bin") everything.push_back(name);
  EXPECT_EQ(names(troupe::core::files_to_pack(root_ + "/project", {}, {".rayignore"})), everything);
  // Exclude patterns match the path or any of its parts.
  auto some = names(troupe::core::files_to_pack(root_ + "/project", {"sub", "*.md", "/cache/"}));
  EXPECT_EQ(some, (std::vector<std::string>{".gitignore", ".rayignore", "app.py", "app.pyd", "keep.log", "lib/build",
                                            "notes", "secret12.txt"}));
}

// Patterns match names per character, as the Python packer (and Ray's)
// decode them: ? and a bracket member are one UTF-8 character, not one
// byte (review r28 found caf?.txt shipped café.txt).
TEST_F(DirPackTest, PatternsMatchNonAsciiNamesPerCharacter) {
  // An overlong sequence (e0 80 80) is three characters to Python.
  write_tree(root_ + "/p", {{".gitignore", "caf?.txt\n[\xc3\xa9]x.txt\n[!\xc3\xa9]y.txt\n?z.txt\n??.md\n???.bin\n"},
                            {"\xe0\x80\x80.bin", ""},
                            {"\xc3\xa9.md", ""},
                            {"\xe2\x82\xac.md", ""},
                            {"ab.md", ""},
                            {"caf\xc3\xa9.txt", ""},
                            {"\xc3\xa9x.txt", ""},
                            {"ay.txt", ""},
                            {"\xc3\xa9y.txt", ""},
                            {"\xe2\x82\xacz.txt", ""},
                            {"ab/z.txt", ""}});
  EXPECT_EQ(names(troupe::core::files_to_pack(root_ + "/p", {})),
            (std::vector<std::string>{".gitignore", "ab/z.txt", "\xc3\xa9.md", "\xc3\xa9y.txt", "\xe2\x82\xac.md"}));
}

// A range of a bracket expression with an end past ASCII was taken byte
// by byte ([à-é] matched à, '-' and é; [a-é] a byte range): it is
// compared by code point, as Python's packer does, across lead bytes,
// sequence lengths and the surrogates; a reversed one drops its rule. The
// expected list is the Python packer's (troupe._packages._files) for the
// same tree.
TEST_F(DirPackTest, RangesPastAsciiCompareCodePoints) {
  std::map<std::string, std::string> tree = {
      {".gitignore",
       "[\xc3\xa0-\xc3\xa9]r.txt\n[a-\xc3\xa9]s.txt\n[\xc3\xbf-\xc4\x81]t.txt\n"
       "[\xe2\x82\xac-\xf0\x90\x80\x80]u.txt\n[\xc3\xa9-\xc3\xa0]v.txt\n[!\xc3\xa0-\xc3\xa9]w.txt\n"}};
  for (const char* name : {"\xc3\xa1r",
                           "\xc3\xaar",
                           "-r",
                           "\xc3\xa0r",
                           "zs",
                           "\xc3\xa7s",
                           "\xc3\xabs",
                           "\xe2\x82\xacs",
                           "\xc4\x80t",
                           "\xc4\x81t",
                           "\xc3\xa4t",
                           "\xe4\xb8\xadu",
                           "\xf0\x9f\x98\x80u",
                           "\xf0\x90\x80\x80u",
                           "\xc3\xa9u",
                           "\xc3\xa9v",
                           "\xc3\xa0v",
                           "\xc3\xa1w",
                           "zw",
                           "\xe2\x82\xacw"})
    tree[std::string(name) + ".txt"] = "";
  write_tree(root_ + "/p", tree);
  EXPECT_EQ(names(troupe::core::files_to_pack(root_ + "/p", {})),
            (std::vector<std::string>{"-r.txt", ".gitignore", "\xc3\xa0v.txt", "\xc3\xa1w.txt", "\xc3\xa4t.txt",
                                      "\xc3\xa9u.txt", "\xc3\xa9v.txt", "\xc3\xaar.txt", "\xc3\xabs.txt",
                                      "\xe2\x82\xacs.txt", "\xf0\x9f\x98\x80u.txt"}));
  // Bytes that are no UTF-8 (a Latin-1 .gitignore, a name in another
  // encoding) are the characters U+DC80 to U+DCFF to Python
  // (surrogateescape): a lone byte matches them, not the sequence it
  // begins elsewhere (review r31).
  write_tree(root_ + "/q", {{".gitignore", "[\xc2\x80-\xf4\x8f\xbf\xbf]a.txt\n[\xe0-\xe9]b.txt\n[\xe1]c.txt\n"},
                            {"\xff"
                             "a.txt",
                             ""},
                            {"\xe1"
                             "b.txt",
                             ""},
                            {"-b.txt", ""},
                            {"\xc3\xa1"
                             "b.txt",
                             ""},
                            {"\xe1"
                             "c.txt",
                             ""},
                            {"\xc3\xa1"
                             "c.txt",
                             ""},
                            {"\xe1\xb8\xbf"
                             "c.txt",
                             ""},
                            {"zb.txt", ""}});
  EXPECT_EQ(names(troupe::core::files_to_pack(root_ + "/q", {})),
            (std::vector<std::string>{"-b.txt", ".gitignore", "zb.txt",
                                      "\xc3\xa1"
                                      "b.txt",
                                      "\xc3\xa1"
                                      "c.txt",
                                      "\xe1\xb8\xbf"
                                      "c.txt"}));
}

TEST_F(DirPackTest, AnArchiveUnpacksToTheSameFilesAndModes) {
  const std::string src = root_ + "/src";
  std::string big(300000, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = char(i * 31 % 251);
  write_tree(src, {{"train.py", "print('hi')\n"}, {"data/big.bin", big}, {"empty", ""}, {"a/b/c/deep.txt", "deep"}});
  fs::permissions(src + "/train.py", fs::perms::owner_exec, fs::perm_options::add);
  fs::create_directory_symlink(src + "/a", src + "/link_to_dir");  // not followed
  fs::create_symlink(src + "/empty", src + "/link_to_file");       // goes as the file
  const auto files = troupe::core::files_to_pack(src, {});
  EXPECT_EQ(names(files),
            (std::vector<std::string>{"a/b/c/deep.txt", "data/big.bin", "empty", "link_to_file", "train.py"}));
  const troupe::Buffer packed = troupe::core::pack_files(files);
  // The same files make the same bytes.
  const troupe::Buffer again = troupe::core::pack_files(troupe::core::files_to_pack(src, {}));
  ASSERT_EQ(packed.size(), again.size());
  EXPECT_EQ(std::memcmp(packed.data(), again.data(), packed.size()), 0);
  const std::string dest = root_ + "/dest";
  troupe::core::unpack_files(packed.data(), packed.size(), dest);
  EXPECT_EQ(read_file(dest + "/data/big.bin"), big);
  EXPECT_EQ(read_file(dest + "/a/b/c/deep.txt"), "deep");
  EXPECT_EQ(read_file(dest + "/train.py"), "print('hi')\n");
  EXPECT_TRUE(fs::exists(dest + "/empty"));
  EXPECT_FALSE(fs::is_symlink(dest + "/link_to_file"));
  EXPECT_NE(fs::status(dest + "/train.py").permissions() & fs::perms::owner_exec, fs::perms::none);
  EXPECT_EQ(fs::status(dest + "/empty").permissions() & fs::perms::owner_exec, fs::perms::none);
  // Unpacked again over itself: the files are there already.
  EXPECT_THROW(troupe::core::unpack_files(packed.data(), packed.size(), dest), troupe::Error);
}

// A file written to between listing and packing (a log): one that grew
// goes as it was listed (packing it failed the whole launch before); one
// that shrank is refused, naming it.
TEST_F(DirPackTest, AFileThatGrowsWhilePackedGoesAsListed) {
  write_tree(root_ + "/src", {{"train.py", "x = 1\n"}, {"run.log", "line 1\n"}});
  auto files = troupe::core::files_to_pack(root_ + "/src", {});
  std::ofstream(root_ + "/src/run.log", std::ios::app) << "line 2\n";
  const troupe::Buffer packed = troupe::core::pack_files(files);
  troupe::core::unpack_files(packed.data(), packed.size(), root_ + "/dest");
  EXPECT_EQ(read_file(root_ + "/dest/run.log"), "line 1\n");
  std::ofstream(root_ + "/src/run.log", std::ios::trunc) << "";
  try {
    troupe::core::pack_files(files);
    ADD_FAILURE() << "a file that shrank was packed";
  } catch (const troupe::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("run.log shrank"), std::string::npos) << e.what();
  }
}

// Every byte string an archive could be cut to, and names that would climb
// out, are refused with an Error; nothing lands outside the destination.
TEST_F(DirPackTest, ADamagedOrHostileArchiveIsRefused) {
  write_tree(root_ + "/src", {{"x/y.txt", "hello"}, {"z.txt", "world"}});
  const troupe::Buffer packed = troupe::core::pack_files(troupe::core::files_to_pack(root_ + "/src", {}));
  for (size_t cut = 0; cut < packed.size(); ++cut) {
    const std::string dest = root_ + "/cut" + std::to_string(cut);
    EXPECT_THROW(troupe::core::unpack_files(packed.data(), cut, dest), troupe::Error) << cut;
  }
  auto archive = [](const std::string& name) {
    std::string s = "TRPK1\n";
    for (int i = 0; i < 8; ++i) s += char(i == 0 ? 1 : 0);
    auto u32 = [&s](uint32_t v) {
      for (int i = 0; i < 4; ++i) s += char((v >> (8 * i)) & 0xff);
    };
    u32(uint32_t(name.size()));
    s += name;
    u32(0644);
    for (int i = 0; i < 8; ++i) s += char(i == 0 ? 2 : 0);
    return s + "hi";
  };
  for (const std::string bad : {"../escape.txt", "/abs.txt", "a/../../escape.txt", "a//b", "", "./x"}) {
    const std::string a = archive(bad);
    try {
      troupe::core::unpack_files(reinterpret_cast<const std::byte*>(a.data()), a.size(), root_ + "/hostile");
      ADD_FAILURE() << "unpacked " << bad;
    } catch (const troupe::Error& e) {
      EXPECT_NE(std::string(e.what()).find("not a path inside it"), std::string::npos) << e.what();
    }
  }
  EXPECT_FALSE(fs::exists(root_ + "/escape.txt"));
  const std::string good = archive("ok/fine.txt");
  troupe::core::unpack_files(reinterpret_cast<const std::byte*>(good.data()), good.size(), root_ + "/good");
  EXPECT_EQ(read_file(root_ + "/good/ok/fine.txt"), "hi");
  EXPECT_THROW(troupe::core::files_to_pack(root_ + "/missing", {}), troupe::ConfigError);
}

}  // namespace
