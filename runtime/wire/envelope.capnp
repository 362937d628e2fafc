# The envelope of every troupe frame. A frame is one Envelope message plus
# zero or more attachments (raw byte blocks sent by scatter/gather after the
# message). Calls and replies are the hot path and carry their fields here
# directly; control-plane bodies (node registration, actor specs, KV...) are
# Codec-encoded structs from protocol.h in `body`.
@0xd6b2a7c41e3f9a05;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("troupe::wire");

enum Kind {
  call @0;        # caller -> worker: run method `method` with args in `body`
  reply @1;       # worker -> caller: result of call `id`
  request @2;     # control request expecting a response with the same `id`
  response @3;    # response to a request
  event @4;       # one-way control message (heartbeat, actor update...)
}

enum Status {
  ok @0;
  error @1;       # errorKind / errorType / errorMessage say what; `body` may be empty
  actorDied @2;   # the target actor died before or while running the call
}

# Which exception an error answer stands for, so that the caller rethrows
# the same type (Future::get). `user` names the class in errorType: a class
# registered with TROUPE_ERROR is rebuilt, any other arrives as RemoteError.
enum ErrorKind {
  none @0;
  user @1;
  actorDied @2;
  timeout @3;
  configError @4;
  aborted @5;
  decodeError @6;
  connectionError @7;
}

struct Envelope {
  kind @0 :Kind;
  id @1 :UInt64;          # call id or request id, echoed in the answer
  op @2 :UInt32;          # call: method index; request/event: protocol Op
  status @3 :Status;
  errorType @4 :Text;
  errorMessage @5 :Text;
  body @6 :Data;          # Codec-encoded payload
  errorKind @7 :ErrorKind;
}
