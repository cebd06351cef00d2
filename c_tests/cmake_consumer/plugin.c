/* A plugin (a shared library a host program loads) that links xcall
 * statically: it exports its own function only, none of xcall's Rust
 * runtime. */
#include <xcall.h>

__attribute__((visibility("default"))) const char *plugin_xcall_version(void) { return xcall_version(); }
