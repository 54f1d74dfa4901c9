// ClientOptions::FromEnvironment against fixed environments (no process
// environment touched): torchrun's and Slurm's variables, what wins, and the
// words of every error (the same as Python's ckpt.environment).
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "ckpt/options.h"

namespace ckpt {
namespace {

constexpr char kDefaultSocket[] = "/run/ckpt/agent.sock";
constexpr char kTail[] =
    "Pass them in ClientEnvironmentGiven or set the variables "
    "(docs/python.md \"Using ckpt from torchrun / Slurm / Kubernetes\").";

absl::StatusOr<ClientOptions> From(std::map<std::string, std::string> vars, ClientEnvironmentGiven given = {},
                                   std::map<std::string, std::string>* sources = nullptr,
                                   std::vector<std::string> paths = {kDefaultSocket}) {
  return ClientOptions::FromEnvironment(given, EnvironmentSource::FromMap(std::move(vars), std::move(paths)), sources);
}

std::map<std::string, std::string> Torchrun() {
  return {{"RANK", "2"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"TORCHELASTIC_RUN_ID", "gpt-run"},
          {"CKPT_META", "meta.example:7400"}};
}

std::map<std::string, std::string> Slurm() {
  return {{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_JOB_ID", "4711"}, {"CKPT_META", "10.0.0.1:7400"},
          {"CKPT_AGENT_SOCKET", "/var/run/ckpt-a/agent.sock"}};
}

TEST(OptionsEnv, TorchrunEnvironment) {
  std::map<std::string, std::string> sources;
  auto o = From(Torchrun(), {}, &sources);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->job_id, "gpt-run");
  EXPECT_EQ(o->rank, 2u);
  EXPECT_EQ(o->world_size, 4u);
  EXPECT_EQ(o->meta_address, "meta.example:7400");
  EXPECT_EQ(o->agent_socket, kDefaultSocket);
  EXPECT_EQ(sources, (std::map<std::string, std::string>{{"job", "$TORCHELASTIC_RUN_ID"},
                                                          {"rank", "$RANK"},
                                                          {"world_size", "$WORLD_SIZE"},
                                                          {"meta", "$CKPT_META"},
                                                          {"agent_socket", "default"}}));
  // Everything else keeps ClientOptions' defaults.
  ClientOptions defaults;
  EXPECT_EQ(o->connect_timeout, defaults.connect_timeout);
  EXPECT_EQ(o->full_save_every, defaults.full_save_every);
  EXPECT_TRUE(o->tls_ca_file.empty());
  EXPECT_TRUE(o->run_id.empty());
}

TEST(OptionsEnv, SlurmEnvironment) {
  std::map<std::string, std::string> sources;
  auto o = From(Slurm(), {}, &sources, {});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->job_id, "4711");
  EXPECT_EQ(o->rank, 5u);
  EXPECT_EQ(o->world_size, 8u);
  EXPECT_EQ(o->meta_address, "10.0.0.1:7400");
  EXPECT_EQ(o->agent_socket, "/var/run/ckpt-a/agent.sock");
  EXPECT_EQ(sources["job"], "$SLURM_JOB_ID");
  EXPECT_EQ(sources["rank"], "$SLURM_PROCID");
  EXPECT_EQ(sources["world_size"], "$SLURM_NTASKS");
  EXPECT_EQ(sources["agent_socket"], "$CKPT_AGENT_SOCKET");
}

TEST(OptionsEnv, PrecedenceGivenThenCkptThenTorchrunThenSlurm) {
  // Both launchers' variables (torchrun inside a Slurm allocation): torchrun's win.
  auto vars = Torchrun();
  for (const auto& [k, v] : Slurm()) vars.emplace(k, v);
  auto o = From(vars);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->job_id, "gpt-run");
  EXPECT_EQ(o->rank, 2u);
  EXPECT_EQ(o->world_size, 4u);
  EXPECT_EQ(o->agent_socket, "/var/run/ckpt-a/agent.sock");

  // $CKPT_JOB wins over a launcher's run id.
  vars["CKPT_JOB"] = "gpt";
  o = From(vars);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->job_id, "gpt");

  // Given values win over every variable.
  ClientEnvironmentGiven given;
  given.job = "given-job";
  given.rank = 0;
  given.world_size = 1;
  given.meta = "given:1";
  given.agent_socket = "/given/agent.sock";
  std::map<std::string, std::string> sources;
  o = From(vars, given, &sources, {});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->job_id, "given-job");
  EXPECT_EQ(o->rank, 0u);
  EXPECT_EQ(o->world_size, 1u);
  EXPECT_EQ(o->meta_address, "given:1");
  EXPECT_EQ(o->agent_socket, "/given/agent.sock");
  for (const auto& [name, from] : sources) EXPECT_EQ(from, "given") << name;

  // A value given for some: the rest from the environment.
  ClientEnvironmentGiven some;
  some.rank = 3;
  o = From(vars, some, &sources);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->rank, 3u);
  EXPECT_EQ(o->world_size, 4u);
  EXPECT_EQ(sources["rank"], "given");
  EXPECT_EQ(sources["world_size"], "$WORLD_SIZE");
}

TEST(OptionsEnv, BlankAndTorchrunNoneCountAsUnset) {
  auto vars = Torchrun();
  vars["TORCHELASTIC_RUN_ID"] = "none";  // torchrun without --rdzv_id
  vars["SLURM_JOB_ID"] = " 99 ";
  vars["CKPT_JOB"] = "  ";
  vars["RANK"] = " 1\n";
  auto o = From(vars);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->job_id, "99");
  EXPECT_EQ(o->rank, 1u);
}

TEST(OptionsEnv, NothingSetNamesEveryPlaceLookedAt) {
  auto o = From({}, {}, nullptr, {});
  ASSERT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(o.status().message(),
            std::string("ClientOptions::FromEnvironment: no job, rank, world_size, meta, agent_socket given, and none "
                        "found in the environment:\n"
                        "  job: no given.job; $CKPT_JOB is not set; $TORCHELASTIC_RUN_ID (torchrun) is not set; "
                        "$SLURM_JOB_ID (Slurm) is not set\n"
                        "  rank: no given.rank; $RANK (torchrun) is not set; $SLURM_PROCID (Slurm) is not set\n"
                        "  world_size: no given.world_size; $WORLD_SIZE (torchrun) is not set; $SLURM_NTASKS (Slurm) "
                        "is not set\n"
                        "  meta: no given.meta; $CKPT_META is not set\n"
                        "  agent_socket: no given.agent_socket; $CKPT_AGENT_SOCKET is not set; /run/ckpt/agent.sock "
                        "(the default) does not exist\n") +
                kTail);
}

TEST(OptionsEnv, EachMissingValueAlone) {
  struct Case {
    const char* drop;
    const char* line;
  };
  const Case cases[] = {
      {"TORCHELASTIC_RUN_ID",
       "  job: no given.job; $CKPT_JOB is not set; $TORCHELASTIC_RUN_ID (torchrun) is not set; $SLURM_JOB_ID (Slurm) "
       "is not set"},
      {"RANK", "  rank: no given.rank; $RANK (torchrun) is not set; $SLURM_PROCID (Slurm) is not set"},
      {"WORLD_SIZE",
       "  world_size: no given.world_size; $WORLD_SIZE (torchrun) is not set; $SLURM_NTASKS (Slurm) is not set"},
      {"CKPT_META", "  meta: no given.meta; $CKPT_META is not set"},
  };
  for (const Case& c : cases) {
    auto vars = Torchrun();
    vars.erase(c.drop);
    auto o = From(vars);
    ASSERT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument) << c.drop;
    std::string name = std::string(c.line).substr(2, std::string(c.line).find(':') - 2);
    EXPECT_EQ(o.status().message(), absl::StrCat("ClientOptions::FromEnvironment: no ", name,
                                                 " given, and none found in the environment:\n", c.line, "\n", kTail))
        << c.drop;
  }
  // The socket: no variable and no default socket on this machine.
  auto o = From(Torchrun(), {}, nullptr, {});
  ASSERT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(o.status().message(),
            absl::StrCat("ClientOptions::FromEnvironment: no agent_socket given, and none found in the environment:\n"
                         "  agent_socket: no given.agent_socket; $CKPT_AGENT_SOCKET is not set; /run/ckpt/agent.sock "
                         "(the default) does not exist\n",
                         kTail));
  // torchrun's "none" run id is named as such.
  auto vars = Torchrun();
  vars["TORCHELASTIC_RUN_ID"] = "none";
  o = From(vars);
  EXPECT_NE(o.status().message().find(
                "$TORCHELASTIC_RUN_ID (torchrun) is \"none\" (torchrun without --rdzv_id: no run name)"),
            std::string::npos)
      << o.status();
}

TEST(OptionsEnv, BadNumbersRefused) {
  auto vars = Torchrun();
  vars["RANK"] = "abc";
  auto o = From(vars);
  ASSERT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(o.status().message(), absl::StrCat("ClientOptions::FromEnvironment: unusable values in the environment:\n"
                                               "  rank: $RANK is 'abc', not an integer >= 0\n",
                                               kTail));

  // A bad value is not skipped for the next variable (Slurm's here).
  vars = Torchrun();
  vars["WORLD_SIZE"] = "-4";
  vars["SLURM_NTASKS"] = "4";
  o = From(vars);
  ASSERT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(o.status().message().find("  world_size: $WORLD_SIZE is '-4', not an integer >= 0\n"), std::string::npos)
      << o.status();

  for (const char* bad : {"1.5", "2x", "0x10", "+-1"}) {
    vars = Torchrun();
    vars["SLURM_PROCID"] = bad;
    vars.erase("RANK");
    o = From(vars);
    EXPECT_NE(o.status().message().find(absl::StrCat("  rank: $SLURM_PROCID is '", bad, "', not an integer >= 0")),
              std::string::npos)
        << bad << ": " << o.status();
  }

  vars = Torchrun();
  vars["WORLD_SIZE"] = "4294967296";
  o = From(vars);
  EXPECT_NE(o.status().message().find("  world_size: $WORLD_SIZE is '4294967296', larger than 4294967295"),
            std::string::npos)
      << o.status();

  // Missing and unusable values in one error, missing first.
  vars = Torchrun();
  vars["RANK"] = "abc";
  vars.erase("CKPT_META");
  o = From(vars);
  EXPECT_EQ(o.status().message(),
            absl::StrCat("ClientOptions::FromEnvironment: no meta given, and none found in the environment:\n"
                         "  meta: no given.meta; $CKPT_META is not set\n"
                         "ClientOptions::FromEnvironment: unusable values in the environment:\n"
                         "  rank: $RANK is 'abc', not an integer >= 0\n",
                         kTail));
}

TEST(OptionsEnv, RankNotBelowWorldSizeRefused) {
  auto vars = Torchrun();
  vars["RANK"] = "4";
  auto o = From(vars);
  ASSERT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(o.status().message(), absl::StrCat("ClientOptions::FromEnvironment: unusable values in the environment:\n"
                                               "  rank: 4 ($RANK) is not below world_size 4 ($WORLD_SIZE)\n",
                                               kTail));
  // A given rank against the environment's world size.
  ClientEnvironmentGiven given;
  given.rank = 9;
  o = From(Slurm(), given);
  EXPECT_NE(o.status().message().find("  rank: 9 (given) is not below world_size 8 ($SLURM_NTASKS)"),
            std::string::npos)
      << o.status();
  // World size 0.
  vars = Torchrun();
  vars["RANK"] = "0";
  vars["WORLD_SIZE"] = "0";
  o = From(vars);
  EXPECT_NE(o.status().message().find("  rank: 0 ($RANK) is not below world_size 0 ($WORLD_SIZE)"), std::string::npos)
      << o.status();
}

TEST(OptionsEnv, ProcessEnvironmentWrapperReads) {
  // Only reads: the real wrapper over getenv/stat (no variable is set here).
  EnvironmentSource env = EnvironmentSource::Process();
  EXPECT_TRUE(env.path_exists("/"));
  EXPECT_FALSE(env.path_exists("/nonexistent/ckpt/agent.sock"));
  EXPECT_FALSE(env.variable("CKPT_OPTIONS_ENV_TEST_SURELY_UNSET").has_value());
  ClientEnvironmentGiven all;
  all.job = "j";
  all.rank = 0;
  all.world_size = 1;
  all.meta = "m:1";
  all.agent_socket = "/s";
  auto o = ClientOptions::FromEnvironment(all);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->job_id, "j");
}

}  // namespace
}  // namespace ckpt
