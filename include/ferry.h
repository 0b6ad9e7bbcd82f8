/*
 * ferry.h - the whole public API of libferry.
 *
 * libferry keeps the big tensors of LLM inference (KV-cache chunks, MoE
 * expert weights) on the cheapest memory tier that is fast enough and moves
 * them between GPU memory, pinned host memory, an NVMe slab and a remote
 * tier at the speed of the link. Each module has its own header under
 * ferry/; this one includes them all.
 */
#ifndef FERRY_H
#define FERRY_H

#include "ferry/core.h"
#include "ferry/device.h"
#include "ferry/io.h"
#include "ferry/remote.h"
#include "ferry/moe.h"
#include "ferry/slab.h"
#include "ferry/gds.h"
#include "ferry/pslab.h"
#include "ferry/kv.h"
#include "ferry/serve.h"

#endif
