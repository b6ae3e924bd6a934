// SPDX-License-Identifier: GPL-2.0-or-later
#include <doctest/doctest.h>

#include "plugin/policy/config.h"
#include "plugin/hypervisor/libvirt_hypervisor.h"

using namespace qcommit::plugin;
using namespace std::chrono_literals;

TEST_CASE("plugin.config.parse") {
  const DaemonConfig c = parse_config(
      "[default]\nbudget=20ms\nfloor=1M\nceiling=1G\n"
      "[pool:nfs]\nbudget=5ms\n"
      "[pool:AAAAAAAA-1111-2222-3333-444444444444]\nceiling=100M\n",
      "t.conf");
  CHECK(c.defaults.budget == 20ms);
  CHECK(c.defaults.floor_bytes_per_s == 1024.0 * 1024);
  CHECK(c.defaults.ceiling_bytes_per_s == 1024.0 * 1024 * 1024);
  const std::string nfs = "nfs", other = "x", uuid = "aaaaaaaa-1111-2222-3333-444444444444";
  CHECK(policy_for_pool(c, &nfs, nullptr).budget == 5ms);
  CHECK(policy_for_pool(c, &nfs, nullptr).floor_bytes_per_s == 1024.0 * 1024);  // inherited
  CHECK(policy_for_pool(c, &other, &uuid).ceiling_bytes_per_s == 100.0 * 1024 * 1024);
  CHECK(policy_for_pool(c, &other, nullptr) == c.defaults);
  CHECK(policy_for_pool(c, nullptr, nullptr) == c.defaults);
  CHECK(parse_config("", "empty.conf").defaults == Policy{});
  // The controller steers each storage request to half the budget (a guest's durable write is
  // a write and a flush); the floor and ceiling pass through.
  const auto cc = c.defaults.controller_config();
  CHECK(cc.latency_budget == 10ms);
  CHECK(cc.floor_rate_bytes_per_s == 1024.0 * 1024);
  CHECK(policy_for_pool(c, &nfs, nullptr).controller_config().latency_budget == 2500us);
}

TEST_CASE("plugin.config.errors") {
  auto err = [](const std::string& text) -> std::string {
    try {
      (void)parse_config(text, "q.conf");
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  CHECK(err("[default]\nbudget=fast\n").find("q.conf: [default] budget: bad duration") == 0);
  CHECK(err("[default]\nbudget=20parsecs\n").find("bad duration unit") != std::string::npos);
  CHECK(err("[default]\nfloor=1X\n").find("bad size unit") != std::string::npos);
  CHECK(err("[default]\nfloor=2G\nceiling=1G\n").find("ceiling must be >= floor") != std::string::npos);
  CHECK(err("[default]\nceiling=2T\n").find("ceiling must be <= 1T") != std::string::npos);
  CHECK(err("[default]\nceiling=1e300T\n").find("bad size unit") != std::string::npos);  // no exponent
  CHECK(err("[default]\nceiling=99999999999999999999T\n").find("larger than 1 PiB") != std::string::npos);
  CHECK(err("[default]\nbudget=61s\n").find("budget must be at most 60s") != std::string::npos);
  CHECK(err("[default]\nbudget=0ms\n").find("budget must be more than 0") != std::string::npos);
  CHECK(err("[default]\nbugdet=1ms\n").find("unknown key 'bugdet'") != std::string::npos);
  CHECK(err("[pools:x]\nbudget=1ms\n").find("unknown section [pools:x]") != std::string::npos);
  CHECK(err("not a key file").find("q.conf:") == 0);
  CHECK_THROWS_AS((void)load_config("/nonexistent/qcommitd.conf", false), ConfigError);
  CHECK(load_config("/nonexistent/qcommitd.conf", true).defaults == Policy{});
}

TEST_CASE("plugin.config.probe") {
  // The shared-queue probe: auto (every 100 ms where the storage can be shared) by default, a
  // period on any storage, or off, per pool.
  const DaemonConfig c = parse_config(
      "[default]\nprobe=200ms\n[pool:nfs]\nprobe=off\n[pool:san]\nbudget=5ms\n"
      "[pool:auto]\nprobe=auto\n",
      "t.conf");
  CHECK(Policy{}.probe == ProbeMode::kAuto);
  CHECK(Policy{}.probe_period == 100ms);
  CHECK(Policy{}.probe_config().enabled);
  CHECK(Policy{}.probe_config().period == 100ms);
  CHECK(parse_config("[default]\nbudget=20ms\n", "d.conf").defaults.probe == ProbeMode::kAuto);
  const std::string nfs = "nfs", san = "san", aut = "auto";
  CHECK(c.defaults.probe == ProbeMode::kOn);
  CHECK(c.defaults.probe_period == 200ms);
  CHECK(policy_for_pool(c, &san, nullptr).probe == ProbeMode::kOn);  // inherited
  CHECK(policy_for_pool(c, &san, nullptr).probe_period == 200ms);
  CHECK(policy_for_pool(c, &nfs, nullptr).probe == ProbeMode::kOff);
  CHECK_FALSE(policy_for_pool(c, &nfs, nullptr).probe_config().enabled);
  CHECK(policy_for_pool(c, &aut, nullptr).probe == ProbeMode::kAuto);
  CHECK(policy_for_pool(c, &aut, nullptr).probe_period == 100ms);
  CHECK_THROWS_WITH_AS((void)parse_config("[default]\nprobe=1ms\n", "q.conf"),
                       doctest::Contains("probe period must be within [10ms, 10s]"), ConfigError);
  CHECK_THROWS_AS((void)parse_config("[default]\nprobe=sometimes\n", "q.conf"), ConfigError);
}

TEST_CASE("plugin.config.domain_override") {
  Policy p;
  CHECK_FALSE(apply_domain_override(
      "<qcommit:policy xmlns:qcommit=\"https://qcommit.dev/xmlns/1\" budget=\"10ms\" floor=\"2M\"/>", p));
  CHECK(p.budget == 10ms);
  CHECK(p.floor_bytes_per_s == 2.0 * 1024 * 1024);
  Policy q;
  auto e = apply_domain_override("<qcommit:policy budget=\"-3\"/>", q);
  REQUIRE(e);
  CHECK(e->find("bad duration") != std::string::npos);
  CHECK(q == Policy{});
  CHECK(apply_domain_override("<qcommit:policy budget=", q));
  CHECK(apply_domain_override("<qcommit:policy color=\"red\"/>", q)->find("unknown attribute") !=
        std::string::npos);
  // As libvirt returns it: the namespace declared, the policy nested or not, no other attribute.
  Policy r;
  bool given = false;
  CHECK_FALSE(apply_domain_override(
      "<qcommit:policy xmlns:qcommit='https://qcommit.dev/xmlns/1' ceiling='50M'/>", r, &given));
  CHECK(r.ceiling_bytes_per_s == 50.0 * 1024 * 1024);
  CHECK_FALSE(given);
  CHECK(apply_domain_override("<x:policy xmlns:x='u' x:budget='5ms'/>", r)->find("unknown") !=
        std::string::npos);
  CHECK(*apply_domain_override("<other/>", r) == "domain metadata: no <qcommit:policy/> element");
}

// What `qcommit doctor` reads of a definition: every device='disk' disk in order, also one with
// no local path, its cache and io modes, and whether the domain has <iothreads>.
TEST_CASE("plugin.libvirt.parse_domain_xml") {
  const DomainInfo d = parse_domain_xml(R"(<domain type='kvm'><name>d</name>
    <iothreads>1</iothreads><devices>
    <disk type='file' device='disk'><driver name='qemu' type='qcow2' cache='none' io='native'/>
      <source file='/p/a.qcow2'/><target dev='vda'/></disk>
    <disk type='network' device='disk'><driver name='qemu' type='raw' cache='writeback'/>
      <source protocol='nbd' name='x'><host name='h'/></source><target dev='vdb'/></disk>
    <disk type='file' device='cdrom'><source file='/p/x.iso'/><target dev='sda'/></disk>
    <disk type='volume' device='disk'><driver name='qemu' type='qcow2'/>
      <source pool='default' volume='v.qcow2'/><target dev='vdc'/></disk>
    </devices></domain>)");
  CHECK(d.iothreads);
  REQUIRE(d.defined_disks.size() == 3);
  CHECK(d.defined_disks[0].target == "vda");
  CHECK(d.defined_disks[0].cache == "none");
  CHECK(d.defined_disks[0].io == "native");
  CHECK(d.defined_disks[1].target == "vdb");
  CHECK(d.defined_disks[1].source.empty());
  CHECK(d.defined_disks[1].cache == "writeback");
  CHECK(d.defined_disks[1].io.empty());
  CHECK(d.defined_disks[2].target == "vdc");
  CHECK(d.defined_disks[2].cache.empty());
  // The governor's list keeps only the disk with a local path.
  REQUIRE(d.disks.size() == 1);
  CHECK(d.disks[0].target == "vda");
  CHECK_FALSE(parse_domain_xml("<domain><devices/></domain>").iothreads);
}

// Which iothread serves each disk: the disk's own (iothread= or, from libvirt 10, the first of its
// <iothreads> mapping), or for a disk on a SCSI bus that of the controller its address names; none
// for a disk left to QEMU's main loop, <iothreads> in the domain or not.
TEST_CASE("plugin.libvirt.parse_domain_xml_iothreads") {
  const DomainInfo d = parse_domain_xml(R"(<domain type='kvm'><name>d</name>
    <iothreads>3</iothreads><devices>
    <disk type='file' device='disk'><driver name='qemu' type='qcow2' iothread='1'/>
      <source file='/p/a.qcow2'/><target dev='vda' bus='virtio'/></disk>
    <disk type='file' device='disk'><driver name='qemu' type='qcow2' queues='2'><iothreads>
      <iothread id='3'><queue id='0'/></iothread><iothread id='2'><queue id='1'/></iothread>
      </iothreads></driver><source file='/p/b.qcow2'/><target dev='vdb' bus='virtio'/></disk>
    <disk type='file' device='disk'><driver name='qemu' type='qcow2'/>
      <source file='/p/c.qcow2'/><target dev='vdc' bus='virtio'/></disk>
    <disk type='file' device='disk'><driver name='qemu' type='qcow2'/>
      <source file='/p/d.qcow2'/><target dev='sda' bus='scsi'/>
      <address type='drive' controller='1' bus='0' target='0' unit='0'/></disk>
    <disk type='file' device='disk'><driver name='qemu' type='qcow2'/>
      <source file='/p/e.qcow2'/><target dev='sdb' bus='scsi'/>
      <address type='drive' controller='0' bus='0' target='0' unit='1'/></disk>
    <controller type='scsi' index='0' model='virtio-scsi'/>
    <controller type='scsi' index='1' model='virtio-scsi'><driver iothread='2'/></controller>
    </devices></domain>)");
  REQUIRE(d.defined_disks.size() == 5);
  CHECK(d.defined_disks[0].iothread == "1");
  CHECK(d.defined_disks[1].iothread == "3");
  CHECK(d.defined_disks[2].iothread.empty());
  CHECK(d.defined_disks[3].iothread == "2");
  CHECK(d.defined_disks[4].iothread.empty());
  const DomainInfo none = parse_domain_xml(R"(<domain><devices>
    <disk type='file' device='disk'><source file='/p/a.qcow2'/><target dev='sda' bus='scsi'/></disk>
    </devices></domain>)");
  REQUIRE(none.defined_disks.size() == 1);
  CHECK(none.defined_disks[0].iothread.empty());
}

TEST_CASE("plugin.libvirt.parse_domain_disks") {
  const auto disks = parse_domain_disks(R"(<domain type='qemu'><name>d</name><devices>
    <disk type='file' device='disk'><driver name='qemu' type='qcow2' cache='none' io='native'/>
      <source file='/p/top.qcow2' index='2'/>
      <backingStore type='file' index='1'><format type='qcow2'/><source file='/p/mid.qcow2'/>
        <backingStore type='file' index='3'><format type='qcow2'/><source file='/p/base.qcow2'/>
          <backingStore/></backingStore></backingStore>
      <mirror type='file' job='active-commit' ready='no'><format type='qcow2'/>
        <source file='/p/base.qcow2' index='3'/></mirror>
      <target dev='vda' bus='virtio'/></disk>
    <disk type='file' device='cdrom'><source file='/p/x.iso'/><target dev='sda'/></disk>
    </devices><metadata><x:y xmlns:x='u'><disk/></x:y></metadata></domain>)");
  REQUIRE(disks.size() == 1);
  CHECK(disks[0].target == "vda");
  CHECK(disks[0].source == "/p/top.qcow2");
  CHECK(disks[0].backing_chain == std::vector<std::string>{"/p/mid.qcow2", "/p/base.qcow2"});
  CHECK(disks[0].mirror == std::optional<std::string>("/p/base.qcow2"));
  CHECK(disks[0].cache == "none");
  CHECK(disks[0].format == "qcow2");
  const auto plain = parse_domain_disks(
      "<domain><devices><disk type='file' device='disk'><driver name='qemu' type='raw'/>"
      "<source file='/p/a.raw'/><target dev='vdb'/></disk></devices></domain>");
  REQUIRE(plain.size() == 1);
  CHECK(plain[0].cache.empty());
  // A block device (dev=), a mirror with a chain of its own (not the disk's), a network disk
  // (no path: left out) and a disk whose <target> comes first.
  const auto more = parse_domain_disks(R"(<domain><devices>
    <disk type='block' device='disk'><target dev='vdc'/><driver type='raw' cache='directsync'/>
      <source dev='/dev/vg/top'/>
      <backingStore type='block'><source dev='/dev/vg/base'/><backingStore/></backingStore>
      <mirror type='file' job='copy'><source file='/p/copy.qcow2'/>
        <backingStore type='file'><source file='/p/copy-base.qcow2'/></backingStore></mirror>
    </disk>
    <disk type='network' device='disk'><source protocol='nbd' name='x'><host name='h'/></source>
      <target dev='vdd'/></disk>
    </devices></domain>)");
  REQUIRE(more.size() == 1);
  CHECK(more[0].target == "vdc");
  CHECK(more[0].source == "/dev/vg/top");
  CHECK(more[0].backing_chain == std::vector<std::string>{"/dev/vg/base"});
  CHECK(more[0].mirror == std::optional<std::string>("/p/copy.qcow2"));
  CHECK(more[0].cache == "directsync");
  // Not well-formed: nothing, rather than the disks before the error.
  CHECK(parse_domain_disks("<domain><devices><disk device='disk'><source file='/p/a'/>"
                           "<target dev='vda'/></disk><disk></devices>")
            .empty());
}
