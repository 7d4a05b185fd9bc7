# hybrid_builtin_mappings(OUT): writes the header that compiles the architecture mappings
# (compiler/Import/mappings/*.json) into a binary as kBuiltinMappings. The importer and the fuzz
# target of its config reading both include it.
set(HYBRID_BUILTIN_MAPPINGS kimi_linear deepseek_v32 hybrid)
function(hybrid_builtin_mappings out)
  set(mapping_entries "")
  foreach(mapping ${HYBRID_BUILTIN_MAPPINGS})
    set(mapping_file ${HYBRID_SOURCE_DIR}/compiler/Import/mappings/${mapping}.json)
    file(READ ${mapping_file} mapping_text)
    string(APPEND mapping_entries
           "    {\"${mapping}\", R\"hybrid_mapping(${mapping_text})hybrid_mapping\"},\n")
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${mapping_file})
  endforeach()
  file(CONFIGURE OUTPUT ${out}
    CONTENT "// Generated from compiler/Import/mappings/*.json by CMake.\nconst std::pair<const char *, const char *> kBuiltinMappings[] = {\n${mapping_entries}};\n"
    @ONLY)
endfunction()
