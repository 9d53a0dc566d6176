// XLA FFI attribute decoding of BlinkSchedConfig: the handlers take the scheduler config as
// named attributes whose names are the struct's fields.
#pragma once
#include "sched_state.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    BlinkSchedConfig, ::xla::ffi::StructMember<int64_t>("mailbox"),
    ::xla::ffi::StructMember<int64_t>("num_slots"), ::xla::ffi::StructMember<int64_t>("max_prompt"),
    ::xla::ffi::StructMember<int64_t>("ring_capacity"),
    ::xla::ffi::StructMember<int64_t>("max_top_logprobs"),
    ::xla::ffi::StructMember<int64_t>("vocab_size"), ::xla::ffi::StructMember<int64_t>("max_seqs"),
    ::xla::ffi::StructMember<int64_t>("max_context"), ::xla::ffi::StructMember<int64_t>("page_size"),
    ::xla::ffi::StructMember<int64_t>("num_pages"),
    ::xla::ffi::StructMember<int64_t>("token_budget"),
    ::xla::ffi::StructMember<int64_t>("num_buckets"), ::xla::ffi::StructMember<int64_t>("bucket0"),
    ::xla::ffi::StructMember<int64_t>("bucket1"), ::xla::ffi::StructMember<int64_t>("bucket2"),
    ::xla::ffi::StructMember<int64_t>("bucket3"), ::xla::ffi::StructMember<int64_t>("bucket4"),
    ::xla::ffi::StructMember<int64_t>("bucket5"), ::xla::ffi::StructMember<int64_t>("bucket6"),
    ::xla::ffi::StructMember<int64_t>("bucket7"), ::xla::ffi::StructMember<int64_t>("eos0"),
    ::xla::ffi::StructMember<int64_t>("eos1"), ::xla::ffi::StructMember<int64_t>("eos2"),
    ::xla::ffi::StructMember<int64_t>("eos3"), ::xla::ffi::StructMember<int64_t>("idle_poll_us"));
