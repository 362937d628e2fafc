// The head's HTTP endpoint (runtime/head/http_endpoint.h) from outside, over
// real sockets: a head that asks for the token refuses a request without
// it or with a wrong one (401, a one-line reason), sends a browser to the
// login form, takes the bearer header or the form's cookie; a garbage
// request hurts nothing (the head still serves HTTP and its own protocol).
// And the metrics text escapes what jobs name.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <asio.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "tests/support/wait.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/head/head.h"
#include "troupe/runtime/head/http_server.h"
#include "troupe/runtime/head/metrics.h"
#include "troupe/runtime/testing/local_cluster.h"
#include "troupe/runtime/wire/address.h"

namespace {

using troupe::head::Head;
using troupe::head::HeadOptions;

// One request on a fresh connection; the whole answer (the server closes).
// With `half_close`, the client says it sends nothing more (a garbage
// request then ends at once rather than at the server's read timeout).
std::string http(uint16_t port, const std::string& request, bool half_close = false) {
  asio::io_context io;
  asio::ip::tcp::socket s(io);
  s.connect({asio::ip::make_address("127.0.0.1"), port});
  // Bounded: a server that never closes fails the read instead of hanging.
  timeval limit{30, 0};
  ::setsockopt(s.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
  asio::write(s, asio::buffer(request));
  if (half_close) s.shutdown(asio::ip::tcp::socket::shutdown_send);
  std::string out;
  asio::error_code ec;
  char buf[4096];
  for (;;) {
    size_t n = s.read_some(asio::buffer(buf), ec);
    out.append(buf, n);
    if (ec) break;
  }
  return out;
}

std::string get(uint16_t port, const std::string& path, const std::string& extra_headers = "") {
  return http(port, "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + extra_headers + "\r\n");
}

uint16_t port_of(const std::string& url) {
  // http://127.0.0.1:PORT/
  return static_cast<uint16_t>(std::stoi(url.substr(url.rfind(':') + 1)));
}

// An actor whose calls the metrics count.
class MetricsCounted {
 public:
  int ping(int x) { return x; }
  int pid() const { return getpid(); }
};

}  // namespace

TROUPE_ACTOR(MetricsCounted, &MetricsCounted::ping, &MetricsCounted::pid)

namespace {

class DashboardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    HeadOptions o;
    o.token = "the-token";
    o.dashboard_port = 0;
    o.dashboard_require_token = true;
    head_ = std::make_unique<Head>(o);
    head_->start();
    port_ = port_of(head_->dashboard_url());
  }
  std::unique_ptr<Head> head_;
  uint16_t port_ = 0;
};

TEST_F(DashboardTest, RefusesRequestsWithoutOrWithAWrongToken) {
  std::string none = get(port_, "/metrics");
  EXPECT_EQ(none.rfind("HTTP/1.1 401", 0), 0u) << none;
  EXPECT_NE(none.find("missing token"), std::string::npos) << none;
  std::string wrong = get(port_, "/api/status", "Authorization: Bearer not-the-token\r\n");
  EXPECT_EQ(wrong.rfind("HTTP/1.1 401", 0), 0u) << wrong;
  EXPECT_NE(wrong.find("wrong token"), std::string::npos) << wrong;
  std::string prefix = get(port_, "/metrics", "Authorization: Bearer the-token-and-more\r\n");
  EXPECT_EQ(prefix.rfind("HTTP/1.1 401", 0), 0u) << prefix;
  // A browser with the cookie of an earlier cluster on this port is sent
  // to the login form (it got a bare 401 and no way on); a program's wrong
  // bearer token is told so.
  std::string stale = get(port_, "/", "Cookie: troupe_token=an-earlier-clusters\r\n");
  EXPECT_EQ(stale.rfind("HTTP/1.1 303", 0), 0u) << stale;
  EXPECT_NE(stale.find("Location: /login"), std::string::npos) << stale;
  std::string bearer = get(port_, "/", "Authorization: Bearer not-the-token\r\n");
  EXPECT_EQ(bearer.rfind("HTTP/1.1 401", 0), 0u) << bearer;
  EXPECT_NE(bearer.find("log in again at /login"), std::string::npos) << bearer;
}

TEST_F(DashboardTest, ServesMetricsAndStatusWithTheBearerToken) {
  std::string m = get(port_, "/metrics", "Authorization: Bearer the-token\r\n");
  EXPECT_EQ(m.rfind("HTTP/1.1 200", 0), 0u) << m;
  EXPECT_NE(m.find("# TYPE troupe_nodes gauge"), std::string::npos) << m;
  EXPECT_NE(m.find("\ntroupe_head_state_db_written 0\n"), std::string::npos) << m;  // not durable
  std::string s = get(port_, "/api/status", "Authorization: Bearer the-token\r\n");
  ASSERT_EQ(s.rfind("HTTP/1.1 200", 0), 0u) << s;
  auto j = nlohmann::json::parse(s.substr(s.find("\r\n\r\n") + 4));
  EXPECT_TRUE(j["nodes"].is_array());
  EXPECT_TRUE(j["jobs"].is_array());
  // The same document as `troupe status --json` (the head's status call):
  // the same keys, at the top and in its tables (each lacked some).
  troupe::InitOptions io;
  io.address = head_->address();
  io.token = "the-token";
  troupe::Runtime rt = troupe::Runtime::connect(io);
  const auto cli = nlohmann::json::parse(rt.status_json());
  auto keys = [](const nlohmann::json& o) {
    std::vector<std::string> k;
    for (const auto& [key, value] : o.items()) k.push_back(key);
    return k;
  };
  EXPECT_EQ(keys(j), keys(cli)) << j.dump() << "\n" << cli.dump();
  EXPECT_EQ(keys(j["tables"]), keys(cli["tables"]));
  EXPECT_TRUE(cli["head"]["uptime_s"].is_number());
}

TEST_F(DashboardTest, BrowserLogsInWithTheFormAndItsCookie) {
  std::string page = get(port_, "/");
  EXPECT_EQ(page.rfind("HTTP/1.1 303", 0), 0u) << page;
  EXPECT_NE(page.find("Location: /login"), std::string::npos) << page;
  const std::string form = "token=the-token";
  std::string login = http(port_,
                           "POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: "
                           "application/x-www-form-urlencoded\r\nContent-Length: " +
                               std::to_string(form.size()) + "\r\n\r\n" + form);
  ASSERT_EQ(login.rfind("HTTP/1.1 303", 0), 0u) << login;
  EXPECT_NE(login.find("Set-Cookie: troupe_token=the-token; HttpOnly"), std::string::npos) << login;
  std::string in = get(port_, "/", "Cookie: other=1; troupe_token=the-token\r\n");
  EXPECT_EQ(in.rfind("HTTP/1.1 200", 0), 0u) << in.substr(0, 200);
  EXPECT_NE(in.find("<title>troupe dashboard</title>"), std::string::npos);
  std::string bad = http(port_,
                         "POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: "
                         "application/x-www-form-urlencoded\r\nContent-Length: 9\r\n\r\ntoken=abc");
  EXPECT_EQ(bad.rfind("HTTP/1.1 401", 0), 0u) << bad;
}

TEST_F(DashboardTest, GarbageRequestHurtsNeitherEndpointNorHead) {
  static const char kJunk[] = "\x16\x03\x01\x02\x00garbage \xff\xfe\r\n\r\n";  // a NUL inside
  std::string junk = http(port_, std::string(kJunk, sizeof kJunk - 1), true);
  EXPECT_EQ(junk.find("HTTP/1.1 200"), std::string::npos) << junk;
  std::string huge = http(port_, "GET /" + std::string(100000, 'a') + " HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", true);
  EXPECT_EQ(huge.find("HTTP/1.1 200"), std::string::npos);
  std::string m = get(port_, "/metrics", "Authorization: Bearer the-token\r\n");
  EXPECT_EQ(m.rfind("HTTP/1.1 200", 0), 0u) << m;
  // The scheme is case-insensitive (RFC 7235).
  std::string lower = get(port_, "/metrics", "Authorization: bearer the-token\r\n");
  EXPECT_EQ(lower.rfind("HTTP/1.1 200", 0), 0u) << lower;
  // The head's own protocol still answers.
  troupe::InitOptions io;
  io.address = head_->address();
  io.token = "the-token";
  troupe::Runtime rt = troupe::Runtime::connect(io);
  EXPECT_TRUE(rt.nodes().empty());
}

// A hand-typed request whose lines end with bare LFs is answered 400,
// naming why, instead of waiting for a CR LF CR LF until the read deadline
// closes it unanswered; one with the wrong ending after a good line too.
TEST_F(DashboardTest, BareLineFeedsAreAnsweredWithA400) {
  for (const std::string request :
       {"GET /metrics HTTP/1.1\nHost: x\n\n", "GET /metrics HTTP/1.1\r\nHost: x\n\n", "GET /metrics HTTP/1.1\n\r\n"}) {
    std::string answer = http(port_, request);
    EXPECT_EQ(answer.rfind("HTTP/1.1 400", 0), 0u) << answer;
    EXPECT_NE(answer.find("CR LF"), std::string::npos) << answer;
  }
  std::string m = get(port_, "/metrics", "Authorization: Bearer the-token\r\n");
  EXPECT_EQ(m.rfind("HTTP/1.1 200", 0), 0u) << m;
  // The session's dashboard URL ends in '/': "$(cat dashboard)/metrics".
  std::string doubled = get(port_, "//metrics", "Authorization: Bearer the-token\r\n");
  EXPECT_EQ(doubled.rfind("HTTP/1.1 200", 0), 0u) << doubled.substr(0, 200);
  EXPECT_NE(doubled.find("troupe_node_"), std::string::npos) << doubled.substr(0, 400);
  // The absolute form a proxy sends is the same request (it was a 400).
  const std::string host = "127.0.0.1:" + std::to_string(port_);
  for (const std::string& target : {"http://" + host + "/metrics", "HTTP://" + host + "/metrics?x=1"}) {
    std::string absolute =
        http(port_, "GET " + target + " HTTP/1.1\r\nHost: " + host + "\r\nAuthorization: Bearer the-token\r\n\r\n");
    EXPECT_EQ(absolute.rfind("HTTP/1.1 200", 0), 0u) << target << ": " << absolute.substr(0, 200);
    EXPECT_NE(absolute.find("troupe_node_"), std::string::npos) << target;
  }
  std::string bare = http(port_, "GET http://" + host + " HTTP/1.1\r\nHost: " + host + "\r\n\r\n");
  EXPECT_EQ(bare.rfind("HTTP/1.1 ", 0), 0u) << bare.substr(0, 200);
  EXPECT_EQ(bare.rfind("HTTP/1.1 400", 0), std::string::npos) << bare.substr(0, 200);  // "/": the page
}

// Clients that open connections and dribble half-sent requests (a header
// line now and then, never the blank line) do not keep others from being
// served: twice as many as the server keeps open, still sending, and
// /metrics answers all the same. (A server on a pool of two threads was
// stalled by two.) Each dribbler is also cut off: its connection ends.
TEST_F(DashboardTest, SlowClientsDoNotStarveTheOthers) {
  asio::io_context io;
  std::vector<std::unique_ptr<asio::ip::tcp::socket>> slow;
  for (int i = 0; i < 128; ++i) {
    auto s = std::make_unique<asio::ip::tcp::socket>(io);
    s->connect({asio::ip::make_address("127.0.0.1"), port_});
    asio::write(*s, asio::buffer(std::string("GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")));
    slow.push_back(std::move(s));
  }
  for (int round = 0; round < 3; ++round) {
    for (auto& s : slow) {
      asio::error_code ec;
      asio::write(*s, asio::buffer(std::string("X-Slow: 1\r\n")), ec);  // a closed one may refuse
    }
    std::string m = get(port_, "/metrics", "Authorization: Bearer the-token\r\n");
    EXPECT_EQ(m.rfind("HTTP/1.1 200", 0), 0u) << "round " << round << ": " << m;
  }
  // The first dribbler was closed to make room: it reads the end of stream.
  timeval limit{30, 0};
  ::setsockopt(slow.front()->native_handle(), SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
  char buf[64];
  asio::error_code ec;
  slow.front()->read_some(asio::buffer(buf), ec);
  EXPECT_TRUE(ec == asio::error::eof || ec == asio::error::connection_reset) << ec.message();
}

// A flood of connections makes room by closing those still sending their
// request, not one taking its answer: a client reading a large answer
// slowly (a log piece, /metrics of a big cluster) got it cut off when
// more than max_connections others connected meanwhile.
TEST(HttpServerLimits, AFloodDoesNotCutOffAnAnswerBeingTaken) {
  const std::string big(64 << 20, 'x');  // far past the socket buffers: the write waits for the reader
  std::atomic<int> answered{0};
  troupe::head::HttpServerOptions opts;
  opts.max_connections = 8;
  opts.deadline = std::chrono::seconds(120);
  troupe::head::HttpServer server(
      "127.0.0.1", 0,
      [&](const troupe::head::HttpRequest& req, troupe::head::HttpResponse& res) {
        res.set_content(req.path == "/big" ? big : "small", "text/plain");
        answered.fetch_add(1);
      },
      opts);
  const auto port = static_cast<uint16_t>(server.port());
  asio::io_context io;
  asio::ip::tcp::socket reader(io);
  reader.connect({asio::ip::make_address("127.0.0.1"), port});
  asio::write(reader, asio::buffer(std::string("GET /big HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")));
  ASSERT_TRUE(troupe::test::eventually([&] { return answered.load() == 1; }, troupe::test::kWaitBound));
  // Twice the limit of connections that never finish their request.
  std::vector<std::unique_ptr<asio::ip::tcp::socket>> flood;
  for (int i = 0; i < 16; ++i) {
    auto s = std::make_unique<asio::ip::tcp::socket>(io);
    s->connect({asio::ip::make_address("127.0.0.1"), port});
    asio::write(*s, asio::buffer(std::string("GET / HTTP/1.1\r\n")));
    flood.push_back(std::move(s));
  }
  // Served after the flood was admitted (one accepting thread, in order).
  EXPECT_EQ(http(port, "GET /small HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").rfind("HTTP/1.1 200", 0), 0u);
  timeval limit{30, 0};
  ::setsockopt(reader.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
  std::string got;
  asio::error_code ec;
  std::vector<char> buf(1 << 16);
  for (;;) {
    size_t n = reader.read_some(asio::buffer(buf), ec);
    got.append(buf.data(), n);
    if (ec) break;
  }
  EXPECT_EQ(ec, asio::error::eof) << ec.message();
  const size_t body = got.find("\r\n\r\n");
  ASSERT_NE(body, std::string::npos) << got.substr(0, 200);
  EXPECT_EQ(got.size() - body - 4, big.size()) << "the answer was cut off";
}

// A method a route does not take is a 405, a path with no route a 404,
// a body too large a 413 — each answered, none hurting what follows.
TEST_F(DashboardTest, WrongMethodsPathsAndSizesAreAnsweredWithTheirStatus) {
  std::string wrong = http(port_, "DELETE /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
  EXPECT_EQ(wrong.rfind("HTTP/1.1 405", 0), 0u) << wrong;
  EXPECT_NE(wrong.find("\r\nAllow: GET, HEAD\r\n"), std::string::npos) << wrong;
  // HEAD is GET's head (a monitor's probe): its status and length, no body.
  std::string head =
      http(port_, "HEAD /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer the-token\r\n\r\n");
  EXPECT_EQ(head.rfind("HTTP/1.1 200", 0), 0u) << head;
  EXPECT_EQ(head.find("Content-Length: 0\r\n"), std::string::npos) << head;
  EXPECT_EQ(head.substr(head.find("\r\n\r\n") + 4), "") << head;
  std::string missing = get(port_, "/nowhere");
  EXPECT_EQ(missing.rfind("HTTP/1.1 404", 0), 0u) << missing;
  EXPECT_NE(missing.find("/nowhere"), std::string::npos) << missing;
  std::string big =
      http(port_, "POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 300000000\r\n\r\ntoken=", true);
  EXPECT_EQ(big.rfind("HTTP/1.1 413", 0), 0u) << big;
  std::string chunked =
      http(port_, "POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", true);
  EXPECT_EQ(chunked.rfind("HTTP/1.1 400", 0), 0u) << chunked;
  // Two lengths that differ (a smuggling vector): 400 at once (it waited
  // for the longer body until the deadline, and closed without an answer).
  std::string two = http(port_,
                         "POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 3\r\nContent-Length: 100\r\n"
                         "\r\nabc");
  EXPECT_EQ(two.rfind("HTTP/1.1 400", 0), 0u) << two;
  // Bytes that are no HTTP (no line end ever comes): 400 at once, not
  // silence until the deadline. Not half-closed: the answer must not wait
  // for the client's end.
  std::string junk(64, '\x01');
  junk += "\xff\xfe binary";
  std::string refused = http(port_, junk);
  EXPECT_EQ(refused.rfind("HTTP/1.1 400", 0), 0u) << refused;
  std::string form = "other=1&token=the%2Dtoken";  // percent-encoded
  std::string login =
      http(port_, "POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: " + std::to_string(form.size()) +
                      "\r\n\r\n" + form);
  EXPECT_EQ(login.rfind("HTTP/1.1 303", 0), 0u) << login;
  std::string m = get(port_, "/metrics", "Authorization: Bearer the-token\r\n");
  EXPECT_EQ(m.rfind("HTTP/1.1 200", 0), 0u) << m;
}

// A head on loopback needs no token, but answers only requests naming a
// loopback Host (a page that rebound its DNS name to 127.0.0.1 sends its
// own name), and tells a client whose bearer token is wrong.
TEST(DashboardLoopback, ServesLoopbackHostsWithoutATokenAndRefusesOtherHosts) {
  HeadOptions o;
  o.token = "the-token";
  o.dashboard_port = 0;
  Head head(o);
  head.start();
  const uint16_t port = port_of(head.dashboard_url());
  auto with_host = [&](const std::string& host, const std::string& extra = "") {
    return http(port, "GET /api/status HTTP/1.1\r\nHost: " + host + "\r\nConnection: close\r\n" + extra + "\r\n");
  };
  const std::vector<std::string> loopback = {"127.0.0.1:" + std::to_string(port), "localhost", "[::1]:80", "127.0.0.2"};
  for (const std::string& host : loopback) {
    const std::string ok = with_host(host);
    EXPECT_EQ(ok.rfind("HTTP/1.1 200", 0), 0u) << host << ": " << ok.substr(0, 200);
  }
  for (const std::string host : {"attacker.example", "attacker.example:8265", "10.0.0.1", "localhost.evil.example",
                                 "127.0.0.1.attacker.example", "127.0.0.1.attacker.example:8265", "[::2]"}) {
    const std::string refused = with_host(host);
    EXPECT_EQ(refused.rfind("HTTP/1.1 403 Forbidden\r\n", 0), 0u) << host << ": " << refused.substr(0, 200);
    EXPECT_NE(refused.find("is not a loopback name"), std::string::npos) << refused;
  }
  const std::string wrong = with_host("localhost", "Authorization: Bearer not-the-token\r\n");
  EXPECT_EQ(wrong.rfind("HTTP/1.1 401", 0), 0u) << wrong;
  const std::string right = with_host("localhost", "Authorization: Bearer the-token\r\n");
  EXPECT_EQ(right.rfind("HTTP/1.1 200", 0), 0u) << right.substr(0, 200);
}

// A loopback head told to ask for the token as well keeps the Host check:
// it answered a rebound name that brought the token (probe 15a).
TEST(DashboardLoopback, ALoopbackHeadThatAsksForTheTokenStillRefusesOtherHosts) {
  HeadOptions o;
  o.token = "the-token";
  o.dashboard_port = 0;
  o.dashboard_require_token = true;
  Head head(o);
  head.start();
  const uint16_t port = port_of(head.dashboard_url());
  auto with_host = [&](const std::string& host, const std::string& extra = "") {
    return http(port, "GET /api/status HTTP/1.1\r\nHost: " + host + "\r\nConnection: close\r\n" + extra + "\r\n");
  };
  const std::string token = "Authorization: Bearer the-token\r\n";
  const std::string refused = with_host("evil.example", token);
  EXPECT_EQ(refused.rfind("HTTP/1.1 403 Forbidden\r\n", 0), 0u) << refused.substr(0, 200);
  EXPECT_EQ(with_host("evil.example").rfind("HTTP/1.1 403", 0), 0u);
  EXPECT_EQ(with_host("127.0.0.1", token).rfind("HTTP/1.1 200", 0), 0u);
  EXPECT_EQ(with_host("127.0.0.1").rfind("HTTP/1.1 401", 0), 0u);  // the token is asked for
}

// The exposition format is UTF-8 text: bytes that are not become U+FFFD
// (they made the whole scrape unreadable).
TEST(DashboardMetrics, LabelBytesThatAreNotUtf8AreReplaced) {
  nlohmann::json snap = {
      {"nodes", nlohmann::json::array()},
      {"jobs", {{{"name", std::string("bad\xff\xfe") + "name"}, {"state", "running"}, {"step", 3}}}}};
  const std::string text = troupe::head::prometheus_text(snap);
  EXPECT_NE(text.find("troupe_job_step{job_name=\"bad\xEF\xBF\xBD\xEF\xBF\xBDname\"} 3"), std::string::npos) << text;
  EXPECT_EQ(text.find('\xff'), std::string::npos);
}

// Tasks' hidden executors are counted apart from the actors, which the
// state API lists without them.
TEST(DashboardMetrics, TaskExecutorsAreCountedApartFromActors) {
  nlohmann::json snap = {{"nodes", nlohmann::json::array()},
                         {"actors",
                          {{{"class", "TaskExecutor"}, {"state", "ALIVE"}},
                           {{"class", "TaskExecutor"}, {"state", "DEAD"}},
                           {{"class", "Counter"}, {"state", "ALIVE"}},
                           "not an object"}}};
  const std::string text = troupe::head::prometheus_text(snap);
  EXPECT_NE(text.find("troupe_actors{state=\"ALIVE\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("troupe_actors{state=\"DEAD\"} 0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("troupe_task_executors{state=\"ALIVE\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("troupe_task_executors{state=\"DEAD\"} 1\n"), std::string::npos) << text;
}

TEST(DashboardMetrics, EscapesLabelValuesAndRendersJobs) {
  nlohmann::json snap = {{"nodes", nlohmann::json::array()},
                         {"jobs",
                          {{{"name", "a \"quoted\" \\ job\nname"},
                            {"state", "running"},
                            {"step", 7},
                            {"data_wait", 0.25},
                            {"recoveries", 1},
                            {"world_size", 2}}}}};
  const std::string text = troupe::head::prometheus_text(snap);
  EXPECT_NE(text.find("troupe_job_step{job_name=\"a \\\"quoted\\\" \\\\ job\\nname\"} 7"), std::string::npos) << text;
  // No live node: the cluster's capacity is there, and 0.
  EXPECT_NE(text.find("troupe_cluster_resource_capacity{resource=\"CPU\"} 0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("troupe_cluster_resource_used{resource=\"GPU\"} 0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("troupe_job_running{job_name=\"a \\\"quoted\\\" \\\\ job\\nname\"} 1"), std::string::npos);
  EXPECT_NE(text.find("# TYPE troupe_job_recoveries_total counter"), std::string::npos);
  EXPECT_NE(text.find("troupe_job_data_wait{job_name=\"a \\\"quoted\\\" \\\\ job\\nname\"} 0.25"), std::string::npos)
      << text;
  snap["workers"] = {{"calls_total", 1234}, {"calls_per_second", 56.5}, {"stream_bytes_total", 789}};
  const std::string with_workers = troupe::head::prometheus_text(snap);
  EXPECT_NE(with_workers.find("troupe_actor_calls_total 1234\n"), std::string::npos) << with_workers;
  EXPECT_NE(with_workers.find("troupe_actor_calls_per_second 56.5\n"), std::string::npos);
  EXPECT_NE(with_workers.find("troupe_stream_received_bytes_total 789\n"), std::string::npos);
}

// Job documents are the KV store's, where any client writes: a diverged
// job's loss (NaN, null in JSON) is NaN, not 0, and a malformed document
// is left out instead of failing every scrape (it used to answer 500).
TEST(DashboardMetrics, ANanLossIsNanAndAMalformedJobIsLeftOut) {
  nlohmann::json snap = {{"nodes", nlohmann::json::array()},
                         {"jobs",
                          {{{"name", "diverged"}, {"state", "running"}, {"step", 120}, {"loss", nullptr}},
                           {{"name", 5}, {"state", 7}, {"step", "x"}},
                           "not an object",
                           {{"name", "odd"}, {"state", 7}, {"step", "x"}}}}};
  const std::string text = troupe::head::prometheus_text(snap);
  EXPECT_NE(text.find("troupe_job_loss{job_name=\"diverged\"} NaN\n"), std::string::npos) << text;
  EXPECT_NE(text.find("troupe_job_step{job_name=\"odd\"} 0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("troupe_job_running{job_name=\"odd\"} 0\n"), std::string::npos) << text;
  EXPECT_EQ(text.find("job=\"5\""), std::string::npos) << text;
}

// /metrics counts a SIGKILLed worker's last calls: its agent reads them
// from the worker's stats page after the reap. The worker's own
// publication, once a second, missed the calls after its last one.
TEST(DashboardMetrics, AKilledWorkersLastCallsAreCounted) {
  troupe::testing::LocalClusterOptions o;
  o.nodes = {{{"CPU", 2}}};
  o.dashboard = true;
  troupe::testing::LocalCluster cluster(o);
  troupe::Runtime rt = cluster.connect();
  const uint16_t port = port_of(cluster.dashboard_url());
  std::string metrics;  // the last scrape, for a failure's message
  auto calls_total = [&]() -> long {
    metrics = http(port, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    const std::string name = "\ntroupe_actor_calls_total ";
    const auto at = metrics.find(name);
    return at == std::string::npos ? -1 : std::stol(metrics.substr(at + name.size()));
  };
  auto a = rt.spawn<MetricsCounted>({.resources = {{"CPU", 1}}});
  const int pid = a.call(&MetricsCounted::pid).get(troupe::test::kWaitBound);
  // Its first publication (within 100 ms of its first call) is in; from
  // now on it publishes at most once a second.
  ASSERT_TRUE(troupe::test::eventually([&] { return calls_total() >= 1; })) << metrics;
  constexpr int kCalls = 300;
  std::vector<troupe::Future<int>> pings;
  for (int i = 0; i < kCalls; ++i) pings.push_back(a.call(&MetricsCounted::ping, i));
  for (auto& p : pings) p.get(troupe::test::kWaitBound);
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  ASSERT_TRUE(troupe::test::eventually([&] { return rt.actor_info(a.id()).state == troupe::ActorState::kDead; }));
  EXPECT_EQ(calls_total(), kCalls + 1) << metrics;
}

}  // namespace
