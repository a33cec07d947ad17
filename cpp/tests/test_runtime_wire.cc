// Decoders of peer bytes (src/runtime/wire.h): what a peer sends is checked
// before anything is allocated from it, and every refusal names the peer.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "../src/runtime/wire.h"

namespace baton::runtime::wire {
namespace {

std::string refusal(std::string_view meta, int peer = 3) {
  try {
    decode_meta(meta, peer);
  } catch (const ExecutionError& e) {
    EXPECT_EQ(e.failed_rank, peer);
    return e.what();
  }
  return "";
}

TEST(RuntimeWire, MetaRoundTrips) {
  const Layout l = {
      {DType::F32, {4, 64, 256}}, {DType::I32, {4}}, {DType::Bool, {}}, {DType::BF16, {0, 7}}};
  EXPECT_EQ(decode_meta(encode_meta(l), 1), l);
  EXPECT_EQ(decode_meta(encode_meta({}), 1), Layout{});
}

TEST(RuntimeWire, MalformedMetaIsRefusedNamingThePeer) {
  const std::string head = "malformed transfer header from rank 3: ";
  EXPECT_EQ(refusal(""), head + "it ends before the tensor count");
  EXPECT_EQ(refusal("x"), head + "the tensor count is not a number");
  // a count far beyond what the bytes can hold: refused before any allocation
  EXPECT_EQ(refusal("18446744073709551615\n0 0\n"),
            head + "it announces 18446744073709551615 tensors in 25 bytes");
  EXPECT_EQ(refusal("1\n13 0\n"), head + "tensor 0: unknown dtype code 13");
  EXPECT_EQ(refusal("1\n-1 0\n"), head + "tensor 0: unknown dtype code -1");
  EXPECT_EQ(refusal("1\n0 999999999999 1\n"),
            head + "tensor 0: rank 999999999999 but only 1 values follow");
  EXPECT_EQ(refusal("1\n0 1 -4\n"), head + "tensor 0: dimension 0 is not a size");
  EXPECT_EQ(refusal("1\n0 2 4294967296 4294967296\n"),
            head + "tensor 0 claims more than 1099511627776 bytes");
  EXPECT_EQ(refusal("1\n0 1 4\n5"), head + "1 unexpected values at its end");
  // an empty tensor may have huge other dimensions: it has no bytes
  EXPECT_EQ(decode_meta("1\n0 2 0 9223372036854775807\n", 3).at(0).shape.at(1),
            int64_t{9223372036854775807});
}

TEST(RuntimeWire, MetaLengthIsBoundedBeforeItIsAllocated) {
  EXPECT_NO_THROW(check_meta_len(kMaxMetaBytes, 2));
  try {
    check_meta_len(uint64_t{1} << 62, 2);
    FAIL() << "accepted";
  } catch (const ExecutionError& e) {
    EXPECT_EQ(e.failed_rank, 2);
    EXPECT_NE(std::string(e.what()).find("from rank 2: it claims 4611686018427387904 bytes"),
              std::string::npos)
        << e.what();
  }
}

TEST(RuntimeWire, AddressBlobs) {
  const std::vector<char> a1(16, 'a'), a2(16, 'b');
  const std::string blob = encode_addresses({a1, a2});  // rank 0's, world 3: for 1, then 2
  EXPECT_EQ(address_for(blob, 0, 1, 3), a1);
  EXPECT_EQ(address_for(blob, 0, 2, 3), a2);
  for (const std::string& bad :
       {blob.substr(0, 30), std::string(), std::string("\xff\xff\xff\xff", 4)}) {
    try {
      address_for(bad, 0, 2, 3);
      FAIL() << "accepted";
    } catch (const ExecutionError& e) {
      EXPECT_EQ(e.failed_rank, 0);
      EXPECT_NE(std::string(e.what()).find("rank 2: gloo start-up: the address published by "
                                           "rank 0 is malformed"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_THROW(address_for(blob, 1, 1, 3), ExecutionError);  // no address for oneself
}

TEST(RuntimeWire, ControlMessagesAndAbortNotes) {
  ControlMsg m;
  m.kind = kMsgAbort;
  m.origin = 7;                              // not a rank of a world of 4: the sender is blamed
  std::memset(m.text, 'x', sizeof(m.text));  // no terminator
  const Control c = decode_control(m, 2, 4);
  EXPECT_EQ(c.kind, kMsgAbort);
  EXPECT_EQ(c.origin, 2);
  EXPECT_EQ(c.text.size(), sizeof(m.text) - 1);
  m.origin = 1;
  EXPECT_EQ(decode_control(m, 2, 4).origin, 1);

  const AbortNote a = decode_abort_note(encode_abort_note(1, "rank 1: boom|again"), 4);
  EXPECT_EQ(a.origin, 1);
  EXPECT_EQ(a.reason, "rank 1: boom|again");
  EXPECT_EQ(decode_abort_note("99999999999|x", 4).origin, -1);
  EXPECT_EQ(decode_abort_note("4|x", 4).origin, -1);
  EXPECT_EQ(decode_abort_note(" 1|x", 4).origin, -1);
  const AbortNote plain = decode_abort_note("no separator", 4);
  EXPECT_EQ(plain.origin, -1);
  EXPECT_EQ(plain.reason, "no separator");
}

}  // namespace
}  // namespace baton::runtime::wire
