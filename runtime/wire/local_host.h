// What this machine has: the network interface that carries an address,
// and TCP ports free for a listener that others are told of beforehand
// (MASTER_PORT). Used by `troupe torchrun`'s slots and by TorchTrainer's
// workers (through the Python module).
#pragma once

#include <cstdint>
#include <string>

namespace troupe::wire {

// The interface that carries `address` (an IPv4 or IPv6 literal) on this
// machine; "" when none does.
std::string interface_of(const std::string& address);

// A TCP port free now (bound on IPv4's any-address), outside the ephemeral range when
// one is: a port from inside it, free when looked at, can be taken by any
// outgoing connect on the machine before the listener told of it binds
// it. Random, so that jobs on one node rarely try the same; the kernel's
// pick when none outside is free. Error when no port is free at all.
uint16_t free_listen_port();

}  // namespace troupe::wire
