#ifndef STRIDE_H
#define STRIDE_H
// The distance between one thread's elements: a block's width.
#define ELEMENT_STRIDE block_size_x
#endif
