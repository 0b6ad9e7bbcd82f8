/* consumer.c - a program built against the installed libferry, as C and as
 * C++, through pkg-config and through the CMake package. */
#include <ferry.h>
#include <ferry/testctl.h>
#include <stdio.h>
#include <string.h>

int main(void)
{
    if (strcmp(ferry_version(), FERRY_VERSION_STRING) != 0) {
        fprintf(stderr, "version mismatch: %s vs %s\n", ferry_version(), FERRY_VERSION_STRING);
        return 1;
    }
    /* every public _INIT, so that both languages compile each one: C checks
     * the member names, C++ (before C++20) that the list is complete */
    ferry_io_options io_opt = FERRY_IO_OPTIONS_INIT;
    ferry_gds_config gds_cfg = FERRY_GDS_CONFIG_INIT;
    ferry_kv_layout kv_layout = FERRY_KV_LAYOUT_INIT;
    ferry_kv_buffer kv_buf = FERRY_KV_BUFFER_INIT;
    ferry_kv_config kv_cfg = FERRY_KV_CONFIG_INIT;
    ferry_kv_req kv_req = FERRY_KV_REQ_INIT;
    ferry_kv_layers_opt kv_lopt = FERRY_KV_LAYERS_OPT_INIT;
    ferry_moe_gen_options gen_opt = FERRY_MOE_GEN_OPTIONS_INIT;
    ferry_moe_planner_options plan_opt = FERRY_MOE_PLANNER_OPTIONS_INIT;
    ferry_moe_geometry geo = FERRY_MOE_GEOMETRY_INIT;
    ferry_moe_trace_options tr_opt = FERRY_MOE_TRACE_OPTIONS_INIT;
    ferry_moe_sim_options sim_opt = FERRY_MOE_SIM_OPTIONS_INIT;
    ferry_pslab_options ps_opt = FERRY_PSLAB_OPTIONS_INIT;
    ferry_remote_options rem_opt = FERRY_REMOTE_OPTIONS_INIT;
    ferry_slab_options slab_opt = FERRY_SLAB_OPTIONS_INIT;
    ferry_kv_stats kv_st = FERRY_KV_STATS_INIT;
    ferry_gds_stats gds_st = FERRY_GDS_STATS_INIT;
    ferry_pslab_stats ps_st = FERRY_PSLAB_STATS_INIT;
    ferry_slab_stats slab_st = FERRY_SLAB_STATS_INIT;
    ferry_moe_planner_stats plan_st = FERRY_MOE_PLANNER_STATS_INIT;
    ferry_moe_slots_stats slots_st = FERRY_MOE_SLOTS_STATS_INIT;
    ferry_remote_stats rem_st = FERRY_REMOTE_STATS_INIT;
    ferry_device_faults faults = FERRY_DEVICE_FAULTS_INIT;
    ferry_serve_config serve_cfg = FERRY_SERVE_CONFIG_INIT;
    ferry_serve_stats serve_st = FERRY_SERVE_STATS_INIT;
    if (io_opt.size != sizeof io_opt || gds_cfg.direct != 1 || kv_layout.num_layers != 32 ||
        kv_buf.layout.kv != 2 || kv_cfg.tp_world != 1 || kv_cfg.l2_direct != 1 ||
        kv_req.size != sizeof kv_req || gen_opt.seed != 1 || plan_opt.policy != NULL ||
        geo.size != sizeof geo || ps_opt.direct != 1 || rem_opt.size != sizeof rem_opt ||
        slab_opt.size != sizeof slab_opt || kv_st.size != sizeof kv_st ||
        gds_st.size != sizeof gds_st || ps_st.size != sizeof ps_st ||
        slab_st.size != sizeof slab_st || plan_st.size != sizeof plan_st ||
        slots_st.size != sizeof slots_st || rem_st.size != sizeof rem_st ||
        faults.size != sizeof faults || tr_opt.stage != NULL || sim_opt.seed != 1 ||
        sim_opt.hint_accuracy != 0.9 || serve_cfg.size != sizeof serve_cfg ||
        serve_st.size != sizeof serve_st || kv_lopt.size != sizeof kv_lopt ||
        kv_lopt.stream != NULL) {
        fprintf(stderr, "an _INIT macro gave an unexpected value\n");
        return 1;
    }
    ferry_device_options o = FERRY_DEVICE_OPTIONS_INIT;
    o.backend = "host";
    ferry_device *dev = NULL;
    int rc = ferry_device_open(&o, &dev);
    if (rc < 0) {
        fprintf(stderr, "open: %s\n", ferry_strerror(rc));
        return 1;
    }
    ferry_devptr p = 0;
    rc = ferry_device_alloc(dev, 4096, &p);
    if (rc == 0)
        rc = ferry_device_free(dev, p);
    ferry_device_close(dev);
    printf("consumer ok: ferry %s, %s\n", ferry_version(), rc == 0 ? "alloc ok" : "alloc failed");
    return rc == 0 ? 0 : 1;
}
